"""Run by an engine venv's python (not the project's): build vLLM's and SGLang's own LiLiCorr head on the CPU, load a
part's weights through their loaders' rules, and give their start/pair scores and walks for tests/test_lilicorr.py's
cases (`run_vllm`, `run_sglang`, called by tests/dflash_engines.py).

A case: {"dflash_config": {lilicorr_*}, "hidden_size", "block_size", "rms_norm_eps", "weights":
{"lilicorr.<name>": t}, "inputs": {token_embeddings [A,S,K,H], log_probs [A,S,K], candidates [A,S,K], pass_hidden
[A,S,H], anchor_hidden [A,H], anchor_valid [A], uniforms [A,S], temperature}}. What a run gives: {start [A,K],
pair [A,S-1,K,K], greedy [A,S] token ids, (SGLang) sampled [A,S] and q [A,S,K], missing / unexpected weight names}.
"""

from __future__ import annotations

import socket
import sys
import warnings
from types import SimpleNamespace

import torch

warnings.filterwarnings("ignore")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def walk_from_row_zero(scores: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """vLLM's walk (dflash2/speculator.py's Triton kernel, which has no CPU path), greedy: previous = 0, then each
    step takes the argmax of row `previous` of its [K, K] scores (step 0's rows all hold the start scores)."""
    previous = torch.zeros(scores.shape[0], dtype=torch.long)
    picks = []
    for step in range(scores.shape[1]):
        previous = scores[torch.arange(scores.shape[0]), step, previous].argmax(-1)
        picks.append(candidates[torch.arange(scores.shape[0]), step, previous])
    return torch.stack(picks, 1)


def run_vllm(case: dict) -> dict:
    import vllm034

    vllm034.install()  # 0.34's model modules in place of 0.32's
    from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized
    from vllm.model_executor.models.lilicorr import LiLiCorrHead
    from vllm.model_executor.models.utils import AutoWeightsLoader

    with set_current_vllm_config(VllmConfig(compilation_config=CompilationConfig(mode=0))):  # eager: no compile
        if not model_parallel_is_initialized():  # one rank, as `vllm serve` on one CPU
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
            initialize_model_parallel(1, 1)
        head = LiLiCorrHead(model_hidden_size=case["hidden_size"], block_size=case["block_size"],
                            rms_norm_eps=case["rms_norm_eps"], config=case["dflash_config"], prefix="lilicorr")
    # LiLiCorrForCausalLM.load_weights: "lilicorr."-prefixed names go, prefix removed, to the head's AutoWeightsLoader
    # (which raises on a name it has no parameter for); then materialize_inference_buffers
    named = [(k.removeprefix("lilicorr."), v) for k, v in case["weights"].items() if k.startswith("lilicorr.")]
    loaded = AutoWeightsLoader(head).load_weights(named)
    params = {k for k, _ in head.named_parameters()}
    head.materialize_inference_buffers(torch.device("cpu"), head.slot_embedding.dtype)  # the end of load_weights
    for module in head.modules():  # then the loader's process_weights_after_loading (the CPU GEMM's weight layout)
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
    x = case["inputs"]
    with torch.no_grad():
        scores = head(x["token_embeddings"], x["log_probs"], x["pass_hidden"], x["anchor_hidden"], x["anchor_valid"])
    return {"start": scores[:, 0, 0], "pair": scores[:, 1:], "greedy": walk_from_row_zero(scores, x["candidates"]),
            "missing": sorted(params - set(loaded)), "unexpected": sorted(set(loaded) - params)}


def stand_in_torchvision() -> None:
    """SGLang's import chain reaches `import torchvision.transforms` (its InternVL image helpers); the engine venv has
    no torchvision (its compiled operators do not load against the CPU torch: tools/engine_venv.sh), and nothing
    here reads an image, so an empty stand-in serves when the real one is absent."""
    import importlib.util
    from unittest import mock

    if "torchvision" not in sys.modules and importlib.util.find_spec("torchvision") is None:
        from transformers.utils.import_utils import is_torchvision_available

        is_torchvision_available()  # cached before the stand-in exists: transformers keeps to its text paths
        for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.functional", "torchvision.io"):
            sys.modules[name] = mock.MagicMock(__name__=name, __spec__=None)


def run_sglang(case: dict) -> dict:
    stand_in_torchvision()
    from sglang.srt.models.lilicorr import LiLiCorrHead, check_head_weight_coverage
    from sglang.srt.speculative.lilicorr_utils import parse_lilicorr_draft_config

    config = parse_lilicorr_draft_config(draft_hf_config=SimpleNamespace(dflash_config=case["dflash_config"]))
    head = LiLiCorrHead(model_hidden_size=case["hidden_size"], block_size=case["block_size"],
                        rms_norm_eps=case["rms_norm_eps"], config=config, prefix="lilicorr")
    # LiLiCorrDraftModel.load_weights: each name's parameter takes it through its weight_loader (names it does not
    # know are skipped), then check_head_weight_coverage refuses missing or unexpected "lilicorr." names
    params = dict(head.named_parameters())
    seen = set()
    for name, value in case["weights"].items():
        seen.add(name)
        param = params.get(name.removeprefix("lilicorr."))
        if param is not None:
            getattr(param, "weight_loader", lambda p, v: p.data.copy_(v))(param, value)
    error = ""
    try:
        check_head_weight_coverage(head, seen)
    except ValueError as e:
        error = str(e)
    head.materialize_inference_buffers(torch.device("cpu"), head.slot_embedding.dtype)
    x = case["inputs"]
    a = x["log_probs"].shape[0]
    common = dict(token_embeddings=x["token_embeddings"], candidate_tokens=x["candidates"],
                  candidate_log_probs=x["log_probs"], pass_hidden=x["pass_hidden"], anchor_hidden=x["anchor_hidden"],
                  anchor_valid=x["anchor_valid"], uniforms=x["uniforms"],
                  temperatures=torch.full((a,), float(x["temperature"])))
    with torch.no_grad():
        blocks = {k: x[k][:, None] for k in ("token_embeddings", "pass_hidden", "anchor_hidden", "anchor_valid")}
        start, pair = head.score(candidate_log_probs=x["log_probs"][:, None], **blocks)
        start, pair = head.log_factors(start, pair)
        greedy, _ = head.select_with_proposal(greedy_mask=torch.ones(a, dtype=torch.bool), **common)
        sampled, q = head.select_with_proposal(greedy_mask=torch.zeros(a, dtype=torch.bool), **common)
    return {"start": start[:, 0], "pair": pair[:, 0], "greedy": greedy, "sampled": sampled, "q": q,
            "coverage_error": error}
