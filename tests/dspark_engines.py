"""Run by an engine venv's python (not the project's): build vLLM's own DSpark Markov and confidence heads on the CPU,
load a drafter's `markov_head.*` and `confidence_head.*` weights through its loader's rules, and write what they
compute for tests/test_dspark.py's cases (`run_vllm`, called by tests/dflash_engines.py).

A case: {"vocab_size", "hidden_size", "markov_rank", "with_markov", "weights": {name: t}, "inputs":
{"prev" [N] token ids, "hidden" [N, H]}}. What a run gives: {"bias" [N, V] the Markov logit term, "confidence"
[N] sigmoid of the confidence head, "missing" / "unexpected" weight names}.
"""

from __future__ import annotations

import warnings

import torch
from lilicorr_engines import free_port

warnings.filterwarnings("ignore")


def run_vllm(case: dict) -> dict:
    import vllm034

    vllm034.install()  # 0.34's model modules in place of 0.32's
    from torch import nn
    from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.models.qwen3_dspark import DSparkConfidenceHead, DSparkMarkovHead
    from vllm.model_executor.models.utils import AutoWeightsLoader

    v, h, r = case["vocab_size"], case["hidden_size"], case["markov_rank"]
    with set_current_vllm_config(VllmConfig(compilation_config=CompilationConfig(mode=0))):  # eager: no compile
        if not model_parallel_is_initialized():  # one rank, as `vllm serve` on one CPU
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
            initialize_model_parallel(1, 1)
        # Qwen3DSparkModel's two heads under the names its load_weights gives them (after its "model." prefix)
        heads = nn.Module()
        heads.markov_head = DSparkMarkovHead(v, v, r, prefix="markov_head")
        heads.confidence_head = DSparkConfidenceHead(h + (r if case["with_markov"] else 0), prefix="confidence_head",
                                                     bias=True, with_markov=case["with_markov"])
        logits = LogitsProcessor(v, scale=1.0)
    loaded = AutoWeightsLoader(heads).load_weights(list(case["weights"].items()))
    for module in heads.modules():  # the loader's process_weights_after_loading (the CPU GEMM's weight layout)
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
    params = {k for k, _ in heads.named_parameters()}
    x = case["inputs"]
    with torch.no_grad():
        embed = heads.markov_head.embed(x["prev"])
        bias = heads.markov_head.bias(embed, logits)
        confidence = torch.sigmoid(heads.confidence_head(x["hidden"], embed))  # Qwen3DSparkForCausalLM's
    return {"bias": bias, "confidence": confidence, "missing": sorted(params - set(loaded)),
            "unexpected": sorted(set(loaded) - params)}
