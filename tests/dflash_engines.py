"""Run by the engine venv's python (not the project's): build an engine's own drafter of any variant it serves from
an exported folder, load the folder's weights with its own loader, and draft one block by the engine's own drafting
rule for the variant, for tests/test_engine_drafts.py.

    ENGINE_PYTHON tests/dflash_engines.py IN.pt OUT.pt ENGINE    (ENGINE: dflash, sglang or vllm)

A missing engine, module or file is an error (a traceback, a non-zero exit): only the engine part of .ci/run runs this.

IN.pt: a list of cases {"folder": an exported folder, "target": its target's folder, "inputs": {"features" [n, K*H] the
context's target features at positions 0..n-1, "block" [B] the block [x, MASK, ...] at positions n..n+B-1, "embed" [V,
H] and "head" [V, H] the target's}, "vllm_spec": the --speculative-config export prints (None: no vLLM runtime),
"sglang_pool": the Domino candidate pool of the SGLang command it prints}. OUT.pt: one per case {"hidden" [B, H] the
final-normed block, "logits" [B, V], "drafts" greedy (B - 1; DSpark's anchor-first block: B), "confidence" (DSpark:
[B]; else None), "missing" / "unexpected" weight names}.

The engines' pieces the CPU cannot run, replaced by torch (the test names them too, STAND_INS):
 - SGLang's RadixAttention (its attention backends are CUDA kernels): `ContextAttention`, SDPA of the block's queries
   over the context K/V SGLang's own worker writes (kv_proj_only, apply_k_norm, apply_k_rope of
   project_target_hidden) and the block's own K/V, both ways (the folders' layers are full, non-causal);
 - vLLM's Attention layer (its CPU backend takes no DFlash arguments): `VllmAttention`, the same, over the context K/V
   vLLM 0.34's precompute_and_store_context_kv writes through it;
 - vLLM 0.34's `ops.rms_norm` with a weight per layer (its context-K norm of all layers in one call), which 0.32's
   CPU kernel runs with the first layer's weight for all: `grouped_rms_norm`, in torch;
 - vLLM's DFlash2 and LiLiCorr walk (a Triton kernel of its speculator, Model Runner V2):
   lilicorr_engines.walk_from_row_zero, its greedy rule in torch, on the scores of vLLM's own CandidateSelector or
   LiLiCorr head;
 - vLLM 0.34's speculators themselves (spec_decode/<method>/speculator.py, which need 0.34's GPU model runner): their
   greedy steps restated below over the model's own methods (LiLiCorr's anchor and scoring, DSpark's Markov chain,
   XPress's Jacobi refinement, whose Triton kernels run interpreted);
 - SGLang's one-rank TP group (its test topology carries metadata only): all_gather, which DSpark's base logits call,
   as the identity.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import types
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

warnings.filterwarnings("ignore")
# SGLang builds (and loads) DSpark's confidence head only under ragged verification, as docs/dspark.md serves it
os.environ.setdefault("SGLANG_RAGGED_VERIFY_MODE", "cap-accept")


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Non-causal attention of q [B, heads*D] over k, v [n, kv_heads*D] (GQA), as [B, heads*D]."""
    q, k, v = (t.reshape(t.shape[0], -1, head_dim).transpose(0, 1) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q[None], k[None], v[None], enable_gqa=True)[0]
    return out.transpose(0, 1).reshape(q.shape[1], -1)


class ContextAttention(torch.nn.Module):
    """The stand-in for an engine's attention layer: the block attends to the context K/V given and to itself."""

    def __init__(self, head_dim: int) -> None:
        super().__init__()
        self.head_dim, self.k, self.v = head_dim, None, None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if kwargs.get("sinks") is not None:
            raise NotImplementedError("attention sinks: not in the project's folders")
        return sdpa(q, torch.cat([self.k, k.reshape(k.shape[0], -1)]), torch.cat([self.v, v.reshape(v.shape[0], -1)]),
                    self.head_dim)


def drafts_of(rules: dict, config: dict, logits: torch.Tensor) -> dict:
    """Greedy drafts of one block by the engine's rule for the folder's variant (`rules`: architecture, or "domino",
    -> a function giving the drafts and, DSpark's, the confidences); the argmax of slots 1..B-1 where the engine
    has no rule of its own (DFlash)."""
    name = "domino" if config.get("dflash_config", {}).get("projector_type") == "domino" else config["architectures"][0]
    if name == "DFlashDraftModel":
        return {"drafts": logits[1:].argmax(-1), "confidence": None}
    drafts = rules[name]()
    return drafts if isinstance(drafts, dict) else {"drafts": drafts, "confidence": None}


def run_dflash(case: dict) -> dict:
    """z-lab's `dflash` 0.1.0: its DFlashDraftModel / DFlash2DraftModel, from_pretrained on the folder (plain torch)."""
    import dflash

    folder, x = Path(case["folder"]), case["inputs"]
    config = json.loads((folder / "config.json").read_text())
    cls = getattr(dflash, config["architectures"][0])
    model, info = cls.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    model.eval()
    n, b = x["features"].shape[0], x["block"].shape[0]
    head = torch.nn.Linear(x["head"].shape[1], x["head"].shape[0], bias=False)
    head.weight.data = x["head"]
    with torch.no_grad():
        hidden = model(position_ids=torch.arange(n + b)[None], noise_embedding=x["embed"][x["block"]][None],
                       target_hidden=x["features"][None])[0]
        logits = model.compute_logits(hidden, head)
        propose = lambda: model.propose(hidden[None, 1:], x["block"][:1], head, 0.0)[0][0]  # noqa: E731
        drafts = drafts_of({"DFlash2DraftModel": propose}, config, logits)
    return {"hidden": hidden, "logits": logits, **drafts, "missing": sorted(info["missing_keys"]),
            "unexpected": sorted(info["unexpected_keys"]) + [str(m) for m in info["mismatched_keys"]]}


# config.json's architecture -> SGLang 0.5.23's module whose EntryClass holds the class of that name
SGLANG_MODULES = {"DFlashDraftModel": "dflash", "DFlash2DraftModel": "dflash", "LiLiCorrDraftModel": "lilicorr",
                  "Qwen3DSparkModel": "dspark"}


def run_sglang(case: dict) -> dict:
    """SGLang 0.5.23: its draft model class of the folder's architecture (its EntryClass), load_weights, the context
    K/V as its worker writes them, its forward, and its worker's greedy drafting of the variant (DFlash2's selector,
    LiLiCorr's propose_lilicorr_block, DSpark's Markov block and confidence, Domino's domino_greedy_rollout)."""
    import domino_engines

    domino_engines.prepare()
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead
    from sglang.srt.runtime_context import reset_context
    from sglang.srt.server_args import ServerArgs
    from sglang.test.parallel_groups import publish
    from transformers import Qwen3Config

    reset_context()
    publish(ServerArgs(model_path="dummy", device="cpu"), role="test")
    folder, x = Path(case["folder"]), case["inputs"]
    config = json.loads((folder / "config.json").read_text())
    name = config["architectures"][0]
    cls = getattr(importlib.import_module(f"sglang.srt.models.{SGLANG_MODULES[name]}"), name)
    model = cls(Qwen3Config.from_dict(config)).float()
    weights = {k: v.float() for k, v in load_file(folder / "model.safetensors").items()}
    missing, unexpected = domino_engines.load_and_compare(model, weights)
    n, b = x["features"].shape[0], x["block"].shape[0]
    with torch.no_grad():
        ctx = model.project_target_hidden(x["features"])
        for layer in model.layers:
            attn = layer.self_attn
            k, v = attn.kv_proj_only(model.prepare_context_hidden_for_kv(layer, ctx))
            stand_in = ContextAttention(attn.head_dim)
            stand_in.k, stand_in.v = attn.apply_k_rope(torch.arange(n), attn.apply_k_norm(k)), v
            attn.attn = stand_in
        hidden = model(input_ids=None, positions=torch.arange(n, n + b), forward_batch=None,
                       input_embeds=x["embed"][x["block"]]).hidden_states
        logits = hidden @ x["head"].T  # the target's head (SGLang's DFlash model has none of its own)

        lm_head = ParallelLMHead(x["head"].shape[0], x["head"].shape[1])  # the target's, as the worker attaches it
        lm_head.weight.copy_(x["head"])
        model.lm_head = lm_head
        embed = torch.nn.Embedding.from_pretrained(x["embed"])
        anchor = x["block"][:1]

        def dflash2() -> torch.Tensor:
            ids, vals = model.compute_candidates(hidden[1:])
            scores = model.candidate_selector.build_lattice(candidate_ids=ids[None], unary_logits=vals[None],
                                                            hidden_states=hidden[None, 1:], anchor_token_ids=anchor)
            tokens, _ = model.candidate_selector.sample_path(
                candidate_ids=ids[None], scores=scores, uniforms=torch.zeros(1, b - 1),
                temperatures=torch.ones(1), greedy_mask=torch.ones(1, dtype=torch.bool))
            return tokens[0]

        def lilicorr() -> torch.Tensor:
            """The worker's propose_lilicorr_block, its anchor the last context row (publish_anchor)."""
            from sglang.srt.speculative.lilicorr_utils import propose_lilicorr_block

            return propose_lilicorr_block(head=model.lilicorr, draft_hidden=hidden[None], lm_head=lm_head,
                                          embed_tokens=embed, anchor=ctx[-1:])[0][0]

        def dspark() -> dict:
            """DsparkDraftSampler's greedy block (anchor-first: every slot drafts): compute_base_logits, the Markov
            steps of draft_markov_block (their torch path), compute_confidence."""
            from sglang.srt.distributed import get_tp_group
            from sglang.srt.speculative.dspark_components.dspark_draft import DraftNoise, draft_markov_block
            from sglang.srt.speculative.spec_tp_sync import SpecTpSync

            assert model.sample_from_anchor
            get_tp_group().all_gather = lambda tensor, dim=-1: tensor  # one rank (publish's group has no collectives)
            base, features = model.compute_base_logits(hidden)
            tokens, _ = draft_markov_block(
                markov_head=model.markov_head, base_logits=base[None], anchor_tokens=anchor, draft_hidden=hidden[None],
                step_temperatures=torch.zeros(1), noise=DraftNoise(key=0, offset=torch.zeros(1, dtype=torch.int64)),
                tp_sync=SpecTpSync(SimpleNamespace(world_size=1, rank_in_group=0)), greedy_draft=True)
            confidence, _ = model.compute_confidence(anchor_tokens=anchor, draft_tokens=tokens,
                                                     confidence_features=features[None])
            return {"drafts": tokens[0], "confidence": confidence[0]}

        def domino() -> torch.Tensor:
            """domino_greedy_rollout with the pool of the printed command (SGLang's default where it names none)."""
            from sglang.srt.speculative.domino_utils import domino_greedy_rollout

            return domino_greedy_rollout(
                draft_hidden=hidden[None], bonus_tokens=anchor, target_embedding=embed, lm_head_weight=x["head"],
                prefix_gru=model.prefix_gru, embed_proj=model.embed_proj, vocab_size=x["head"].shape[0],
                shift_label=bool(model.shift_label), candidate_pool_size=case["sglang_pool"], in_cuda_graph=False)[0]

        drafts = drafts_of({"DFlash2DraftModel": dflash2, "LiLiCorrDraftModel": lilicorr, "Qwen3DSparkModel": dspark,
                            "domino": domino}, config, logits)
    return {"hidden": hidden, "logits": logits, **drafts, "missing": missing, "unexpected": unexpected}


class VllmAttention(ContextAttention):
    """ContextAttention built as vLLM's Attention layer is, which takes the context K/V through the cache update
    precompute_and_store_context_kv calls (`attn.impl.do_kv_cache_update`)."""

    def __init__(self, num_heads: int, head_size: int, scale: float, **kwargs) -> None:
        super().__init__(head_size)
        if scale != head_size**-0.5 or kwargs.get("sinks") is not None or kwargs.get("per_layer_sliding_window"):
            raise NotImplementedError(f"attention settings the project's folders do not use: {scale}, {kwargs}")
        self.layer_name, self.kv_cache = kwargs.get("prefix"), None
        object.__setattr__(self, "impl", self)  # not a submodule of itself

    def do_kv_cache_update(self, attn, k: torch.Tensor, v: torch.Tensor, cache, slots) -> None:
        self.k, self.v = k.flatten(1), v.flatten(1)


def grouped_rms_norm(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """vLLM 0.34's `ops.rms_norm` as its context-K path calls it: a weight [L, D] per layer, L the outermost dim of x
    [L, n, heads, D] (`_normalize_context_k`). The CPU kernel of vLLM 0.32 reads weight[0] for every layer."""
    w = weight.view(weight.shape[0], *[1] * (x.dim() - 2), weight.shape[-1]) if weight.dim() == 2 else weight
    out.copy_(x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps).to(x.dtype) * w)


# config.json's architecture -> vLLM 0.34's model class (its vllm/model_executor/models/registry.py)
VLLM_CLASSES = {"DFlashDraftModel": ("qwen3_dflash", "DFlashQwen3ForCausalLM"),
                "DFlash2DraftModel": ("qwen3_dflash2", "DFlash2Qwen3ForCausalLM"),
                "LiLiCorrDraftModel": ("lilicorr", "LiLiCorrForCausalLM"),
                "Qwen3DSparkModel": ("qwen3_dspark", "Qwen3DSparkForCausalLM"),
                "Qwen3XPressModel": ("qwen3_xpress", "Qwen3XPressForCausalLM")}
# a folder's tensors vLLM's load_weights reads but stores transformed, so no parameter holds their values
VLLM_TRANSFORMED = {"xpress_head.mix.L": "read raw and stored as mix_L = L * tril + I by Qwen3XPressForCausalLM"}
# what vLLM's DFlash model holds and a folder does not, by design: the target's embedding and head (shared at load),
# the mask embedding of a `mask_embedding.pt` (none here), the draft-to-target id map (equal vocabularies)
VLLM_NOT_FROM_FOLDER = ("model.embed_tokens.weight", "lm_head.weight", "model.mask_embedding")


def run_vllm(case: dict) -> dict:
    """vLLM 0.34's DFlashQwen3ForCausalLM / DFlash2Qwen3ForCausalLM (tests/vllm034.py), built from its own configs
    (ModelConfig of the target, SpeculativeConfig of the folder), load_weights, process_weights_after_loading,
    precompute_and_store_context_kv, forward, compute_logits; DFlash2: compute_candidates and its selector's scores,
    walked greedily (the walk is a Triton kernel: lilicorr_engines.walk_from_row_zero, its greedy rule in torch)."""
    import vllm034

    vllm034.install()
    from lilicorr_engines import free_port, walk_from_row_zero
    from vllm import _custom_ops as ops
    from vllm.config import (
        CompilationConfig,
        ModelConfig,
        ParallelConfig,
        SpeculativeConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized
    from vllm.model_executor.models import qwen3_dflash  # 0.34's, installed above

    folder, x = Path(case["folder"]), case["inputs"]
    config = json.loads((folder / "config.json").read_text())
    n, b = x["features"].shape[0], x["block"].shape[0]
    target = ModelConfig(model=case["target"], dtype="float32")
    parallel = ParallelConfig()
    spec = SpeculativeConfig(method=case["vllm_spec"]["method"], model=str(folder),
                             num_speculative_tokens=case["vllm_spec"]["num_speculative_tokens"],
                             target_model_config=target, target_parallel_config=parallel)
    # 0.32's VllmConfig refuses DFlash2 for its CPU runtime (Model Runner V1); the model classes read only the
    # speculative config, so it is set after the check
    vllm_config = VllmConfig(model_config=target, parallel_config=parallel,
                             compilation_config=CompilationConfig(mode=0))
    vllm_config.speculative_config = spec
    qwen3_dflash.Attention = VllmAttention  # built in place of vLLM's (whose CPU backend cannot run DFlash)
    qwen3_dflash.ops = types.SimpleNamespace(rms_norm=grouped_rms_norm, rotary_embedding=ops.rotary_embedding)
    module, name = VLLM_CLASSES[config["architectures"][0]]
    cls = getattr(importlib.import_module(f"vllm.model_executor.models.{module}"), name)
    with set_current_vllm_config(vllm_config):
        if not model_parallel_is_initialized():  # one rank, as `vllm serve` on one CPU
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
            initialize_model_parallel(1, 1)
        model = cls(vllm_config=vllm_config, prefix="")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    weights = load_file(folder / "model.safetensors")
    unexpected = []
    try:
        model.load_weights(iter(weights.items()))
    except ValueError as err:  # AutoWeightsLoader refuses a name it has no parameter for
        unexpected.append(str(err))
    import domino_engines

    params = dict(model.named_parameters())
    missing = sorted(k for k, p in params.items() if p.isnan().any() and not k.startswith(VLLM_NOT_FROM_FOLDER))
    unexpected += sorted(k for k, v in weights.items() if k not in VLLM_TRANSFORMED
                         and not any(domino_engines.contains(p, v) for p in params.values()))
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(x["embed"])  # the target's, which vLLM shares with the drafter
        model.lm_head.weight.copy_(x["head"])
        for module in model.modules():  # the loader's process_weights_after_loading (the CPU GEMM's weight layout)
            method = getattr(module, "quant_method", None)
            if method is not None:
                method.process_weights_after_loading(module)
        model.process_weights_after_loading()
        context = model.combine_hidden_states(x["features"])
        model.precompute_and_store_context_kv(context, torch.arange(n), torch.arange(n))
        hidden = model(x["block"], torch.arange(n, n + b))
        logits = model.compute_logits(hidden)

        anchor = x["block"][:1]

        def dflash2() -> torch.Tensor:
            ids, unary = model.compute_candidates(hidden[1:])
            scores = model.model.candidate_selector(ids[None], unary[None], hidden[None, 1:], anchor)
            return walk_from_row_zero(scores, ids[None])[0]

        def lilicorr() -> torch.Tensor:
            """LiLiCorrSpeculator: its anchor (prepare_context_anchor: hidden_norm of the last context row), its
            _score_candidates, the walk of DFlash2's."""
            ids, log_probs = model.compute_candidates(hidden[1:])
            scores = model.model.lilicorr(model.model.embed_tokens(ids)[None], log_probs[None], hidden[None, 1:],
                                          model.model.hidden_norm(context[-1:]), torch.ones(1, dtype=torch.bool))
            return walk_from_row_zero(scores, ids[None])[0]

        def dspark() -> dict:
            """DSparkSpeculator._sample_markov_chain, greedy (no draft logits: greedy_argmax, whose CPU path is an
            argmax), anchor-first: every slot drafts."""
            base, prev, tokens, embeds = model.compute_draft_logits(hidden), anchor, [], []
            for i in range(b):
                embeds.append(model.markov_embed(prev))
                prev = (base[i : i + 1] + model.markov_bias(embeds[-1])).argmax(-1)
                tokens.append(model.map_draft_to_target(prev))
            return {"drafts": torch.cat(tokens), "confidence": model.compute_confidence(hidden, torch.cat(embeds))}

        def xpress() -> torch.Tensor:
            """XPressSpeculator._jacobi_refine: the refiner's Jacobi passes (its Triton kernels, interpreted) over
            the whole block, the anchor standing in for its predecessor."""
            passes = int(getattr(spec.draft_model_config.hf_config, "xpress_num_passes", 6))
            model.model.xpress_head.process_weights_after_loading()  # the fused copies its kernels index
            draft, _ = model.model.xpress_head.jacobi_refine_greedy(model.compute_draft_logits(hidden[None]),
                                                                    hidden[None], anchor, anchor, passes)
            return draft[0]

        drafts = drafts_of({"DFlash2DraftModel": dflash2, "LiLiCorrDraftModel": lilicorr, "Qwen3DSparkModel": dspark,
                            "Qwen3XPressModel": xpress}, config, logits)
    return {"hidden": hidden, "logits": logits, **drafts, "missing": missing, "unexpected": unexpected}


def run_head(case: dict, engine: str) -> dict:
    """A part's head alone on given inputs (a case of tests/test_<part>.py's `engine_cases`, its "head" the part)."""
    import domino_engines
    import dspark_engines
    import lilicorr_engines
    import xpress_engines

    if engine == "sglang":
        domino_engines.prepare()
    runs = {("lilicorr", "vllm"): lilicorr_engines.run_vllm, ("lilicorr", "sglang"): lilicorr_engines.run_sglang,
            ("dspark", "vllm"): dspark_engines.run_vllm, ("xpress", "vllm"): xpress_engines.run}
    return runs[case["head"], engine](case)


if __name__ == "__main__":
    cases, engine = torch.load(sys.argv[1]), sys.argv[3]
    run = {"dflash": run_dflash, "sglang": run_sglang, "vllm": run_vllm}[engine]
    torch.save([run_head(case, engine) if "head" in case else run(case) for case in cases], sys.argv[2])
