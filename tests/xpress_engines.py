"""Run by the engine venv's python (not the project's): build vLLM 0.34's own XPress refiner and speculators 0.9's on
the CPU, load a drafter's `xpress_head.*` weights through vLLM's `load_weights` (and the converted names through
speculators' module), and give what they compute for tests/test_xpress.py's cases (`run`, called by
tests/dflash_engines.py).

vLLM 0.34's model module and its Triton kernels are imported into the engine venv's vLLM 0.32 for the CPU
(tests/vllm034.py, from the files tools/vllm_engine_files.sh keeps in the venv), and the kernels run in Triton's
interpreter (vLLM for the CPU turns Triton off: no CPU backend). A missing engine or file is an error.

A case: {"vocab_size", "hidden_size", "block_size", "config": the folder's xpress fields, "weights":
{"xpress_head.<name>": t}, "speculators_weights": {"refiner_head.<name>": t}, "inputs": {"hidden" [N, B, H], "head"
[V, H], "anchor" [N], "prev" [N, B]}, "num_passes", "topc"}. What a run gives: {"refined" [N, B, V] (vLLM),
"speculators_refined" [N, B, V], "greedy" and "greedy_topc" [N, B-1] (vLLM's jacobi_refine_greedy, the anchor as
prev_0), "missing" / "unexpected" weight names (vLLM's and speculators')}.
"""

from __future__ import annotations

import importlib.util
import types
import warnings

import torch
import vllm034

warnings.filterwarnings("ignore")


def vllm_xpress() -> types.ModuleType:
    """vLLM 0.34's `qwen3_xpress` module, imported into this process's vLLM 0.32."""
    vllm034.install()
    from vllm.model_executor.models import qwen3_xpress

    return qwen3_xpress


def run_vllm(module: types.ModuleType, case: dict) -> dict:
    from torch import nn

    cfg, x = case["config"], case["inputs"]
    n = x["hidden"].shape[0]
    holder = nn.Module()  # Qwen3XPressForCausalLM's head under the name its load_weights gives it
    holder.model = nn.Module()
    holder.model.xpress_head = head = module.XPressRefinerHead(
        vocab_size=case["vocab_size"], hidden_size=case["hidden_size"], block_size=cfg["xpress_block_size"],
        rank=cfg["xpress_rank"], mlp_hidden=cfg["xpress_mlp_hidden"], max_num_reqs=n, topc=cfg["xpress_topc"])
    loaded: set[str] = set()

    class Recording(module.AutoWeightsLoader):  # what vLLM's loader loaded (load_weights itself returns None)
        def load_weights(self, weights, *args, **kwargs):
            out = super().load_weights(weights, *args, **kwargs)
            loaded.update(out)
            return out

    module.AutoWeightsLoader = Recording
    unexpected = []
    try:
        module.Qwen3XPressForCausalLM.load_weights(holder, list(case["weights"].items()))
    except ValueError as err:  # AutoWeightsLoader raises on a name it has no parameter for
        unexpected.append(str(err))
    if "xpress_head.mix.L" in case["weights"]:
        loaded.add("model.xpress_head.mix_L")  # read raw and folded (L * tril + I) by load_weights itself
    head.process_weights_after_loading()
    params = {k for k, _ in holder.named_parameters()}
    with torch.no_grad():
        hidden, lm_head, anchor = x["hidden"], x["head"], x["anchor"]
        base = hidden @ lm_head.T  # [N, B, V] compute_draft_logits: the shared head, scale 1
        refined = base + head.refine_bias(x["prev"], head.hidden_cache(hidden))
        out = {"refined": refined}
        for topc, key in ((0, "greedy"), (case["topc"], "greedy_topc")):
            head.topc = topc
            # XPressSpeculator._jacobi_refine: the anchor stands in for the token before it
            out[key] = head.jacobi_refine_greedy(base, hidden, anchor, anchor, case["num_passes"])[0].clone()
    return {**out, "missing": sorted(params - loaded), "unexpected": unexpected}


def run_speculators(case: dict) -> dict:
    (path,) = vllm034.SPECULATORS_FILES
    spec = importlib.util.spec_from_file_location("speculators_xpress_heads", vllm034.files() / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # torch only
    cfg, x = case["config"], case["inputs"]
    head = module.XPressRefinerHead(
        verifier_vocab_size=case["vocab_size"], draft_vocab_size=case["vocab_size"], hidden_size=case["hidden_size"],
        block_size=case["block_size"], rank=cfg["xpress_rank"],
        mlp_ratio=cfg["xpress_mlp_hidden"] // cfg["xpress_rank"])
    named = {k.removeprefix("refiner_head."): v for k, v in case["speculators_weights"].items()}
    result = head.load_state_dict(named, strict=False)
    with torch.no_grad():
        refined = x["hidden"] @ x["head"].T + head.block_bias(x["prev"], hidden_states=x["hidden"])
    return {"speculators_refined": refined, "missing": result.missing_keys, "unexpected": result.unexpected_keys}


def run(case: dict) -> dict:
    """vLLM's refiner and speculators' on one case, their missing and unexpected names together."""
    theirs, spec = run_vllm(vllm_xpress(), case), run_speculators(case)
    return {**theirs, "speculators_refined": spec["speculators_refined"],
            "missing": theirs["missing"] + spec["missing"], "unexpected": theirs["unexpected"] + spec["unexpected"]}
