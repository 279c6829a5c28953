"""Run by the engine venv's python (not the project's): build SGLang 0.5.23's own DFlashDraftModel on the CPU from a
Domino folder's config.json, load the folder's weights with its load_weights, and draft with its
domino_greedy_rollout, for tests/test_domino.py.

    ENGINE_PYTHON tests/domino_engines.py IN.pt OUT.pt    (exit 3, which fails the test: SGLang is not installed)

IN.pt: a list of cases {"config": config.json as a dict, "weights": {name: bf16 tensor}, "inputs": {"hidden" [A, B, H]
backbone outputs, "first" [A] slot-0 tokens, "embed" [V, H] and "head" [V, H] the target's}, "pools": [pool sizes],
"dtypes": [(a launch's --dtype, a target config.json's dtype)]}.
OUT.pt: one per case {"missing": parameters the folder left unset, "unexpected": folder tensors found in no parameter,
"parsed": the Domino fields SGLang parsed, "drafts": {pool: [A, B - 1]} (fp32), "drafts_bf16": {pool: [A, B - 1]},
"starts": {(--dtype, target dtype): validate_domino_runtime's refusal, None where it starts}}.

SGLang's import chain and its CPU paths need three things beyond `pip install --no-deps sglang==0.5.23`: the
environment SGLANG_USE_CPU_ENGINE=1 (else its rotary embedding reaches for vLLM's CUDA kernels), stand-ins for
torchvision (its multimodal helpers; tests/lilicorr_engines.py) and for sgl_kernel (its compiled kernels, which have
no CPU wheel here; nothing below calls one), and a published one-rank topology (its layers read the TP size from it).
"""

from __future__ import annotations

import copy
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import warnings
from unittest import mock

import torch

warnings.filterwarnings("ignore")
os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")


class _KernelStandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers any `sgl_kernel` import with a module whose every attribute is a MagicMock."""

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "sgl_kernel":
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.__getattr__ = lambda attr: mock.MagicMock(name=f"{module.__name__}.{attr}")


def prepare() -> None:
    """What SGLang's CPU import path needs in this process: the stand-ins for sgl_kernel and torchvision."""
    from lilicorr_engines import stand_in_torchvision

    if not any(isinstance(finder, _KernelStandIn) for finder in sys.meta_path):
        sys.meta_path.insert(0, _KernelStandIn())
    stand_in_torchvision()


def build(config: dict, dtype: torch.dtype):
    """SGLang's DFlashDraftModel of a config.json, built as its loader builds it (default dtype = the folder's)."""
    from sglang.srt.models.dflash import DFlashDraftModel
    from transformers import Qwen3Config

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return DFlashDraftModel(Qwen3Config.from_dict(config))
    finally:
        torch.set_default_dtype(previous)


def contains(param: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether `value`'s elements lie, in order, as one run inside `param` (a fused qkv or gate_up holds its parts
    as row blocks)."""
    p, v = param.detach().flatten().float(), value.flatten().float()
    if v.numel() > p.numel():
        return False
    starts = (p[: p.numel() - v.numel() + 1] == v[0]).nonzero().flatten()  # where the run could begin
    return any(torch.equal(p[s : s + v.numel()], v) for s in starts.tolist())


def load_and_compare(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """`model.load_weights(weights)` (SGLang's own loader); the parameters it left unset (all start as NaN) and the
    tensors found in no parameter (its loader skips names it does not know, silently)."""
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    model.load_weights(iter(weights.items()))
    params = dict(model.named_parameters())
    missing = sorted(name for name, p in params.items() if p.isnan().any())
    unexpected = sorted(name for name, value in weights.items() if not any(contains(p, value) for p in params.values()))
    return missing, unexpected


def run(case: dict) -> dict:
    from sglang.srt.runtime_context import reset_context
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.speculative.domino_utils import domino_greedy_rollout
    from sglang.test.parallel_groups import publish

    reset_context()  # one rank: the layers read the TP size and the TP groups' placement from it (SGLang's own
    publish(ServerArgs(model_path="dummy", device="cpu"), role="test")  # helper for tests without process groups)
    model = build(case["config"], torch.bfloat16)
    missing, unexpected = load_and_compare(model, case["weights"])
    d = model.draft_config
    parsed = {"projector_type": d.projector_type, "shift_label": d.shift_label,
              "pure_draft_prefix_len": d.pure_draft_prefix_len, "gru_hidden_dim": d.gru_hidden_dim,
              "emb_dim": d.emb_dim}
    x = case["inputs"]
    out = {}
    for dtype, key in ((torch.float32, "drafts"), (torch.bfloat16, "drafts_bf16")):
        gru, proj = copy.deepcopy(model.prefix_gru).to(dtype), copy.deepcopy(model.embed_proj).to(dtype)
        embedding = torch.nn.Embedding.from_pretrained(x["embed"].to(dtype))
        out[key] = {pool: domino_greedy_rollout(
            draft_hidden=x["hidden"].to(dtype), bonus_tokens=x["first"], target_embedding=embedding,
            lm_head_weight=x["head"].to(dtype), prefix_gru=gru, embed_proj=proj, vocab_size=x["head"].shape[0],
            shift_label=bool(model.shift_label), candidate_pool_size=pool, in_cuda_graph=False)
            for pool in case["pools"]}
    out["starts"] = {(flag, dtype): starts(model, case["config"], x, flag, dtype) for flag, dtype in case["dtypes"]}
    return {"missing": missing, "unexpected": unexpected, "parsed": parsed, **out}


def starts(model, config: dict, x: dict, flag: str, target_dtype: str | None) -> str | None:
    """What SGLang's Domino runtime check says of a launch with `--dtype flag` for a target whose config.json names
    `target_dtype`: the dtypes its model config gives target and drafter, then validate_domino_runtime on the target's
    embedding and head and the projector in them (a CUDA device named, nothing run on it); None: it starts."""
    from sglang.srt.configs.model_config import _get_and_verify_dtype
    from sglang.srt.speculative.domino_utils import validate_domino_runtime

    target = _get_and_verify_dtype({"dtype": target_dtype, "model_type": "qwen3"}, flag)
    drafter = _get_and_verify_dtype(config, flag)
    head = torch.nn.Linear(x["head"].shape[1], x["head"].shape[0], bias=False, dtype=target)
    try:
        validate_domino_runtime(
            device=torch.device("cuda"), tp_size=1, tp_rank=0, target_vocab_size=head.out_features,
            draft_vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
            target_embedding=torch.nn.Embedding.from_pretrained(x["embed"].to(target)), lm_head=head,
            prefix_gru=copy.deepcopy(model.prefix_gru).to(drafter),
            embed_proj=copy.deepcopy(model.embed_proj).to(drafter))
    except ValueError as e:
        return str(e)
    return None


if __name__ == "__main__":
    if importlib.util.find_spec("sglang") is None:
        print(f"sglang is not installed in {sys.prefix}", file=sys.stderr)
        sys.exit(3)
    prepare()
    cases = torch.load(sys.argv[1])
    torch.save([run(case) for case in cases], sys.argv[2])
