"""`DFlashHiddenStatesConnector`: vLLM's hidden-states connector that runs on the CPU engine as on CUDA.

vLLM's `extract_hidden_states` speculative method stores each token's auxiliary hidden states in a KV-cache group
of their own; a KV connector takes them out when the request finishes. vLLM 0.32's example connector
(`ExampleHiddenStatesConnector`) copies them with CUDA streams, CUDA events and pinned host memory, so on a CPU
engine it fails at the first request. This subclass keeps its scheduler side, its file protocol (one safetensors
file per request, its path in the response's `kv_transfer_params`, a `.lock` file held until the file is complete)
and its asynchronous copy on CUDA, and copies synchronously on other devices (the CPU engine). It also refuses, at
engine start, the settings under which some of a request's hidden states would never be computed (prefix caching,
chunked prefill), writes each file whole (a rename) and puts the layer ids and model in its metadata, so that the
trainer checks it reads the features it asked for.

Runs inside the engine: `vllm serve ... --kv-transfer-config '{"kv_connector": "DFlashHiddenStatesConnector",
"kv_connector_module_path": "dflash_lightning.engine.vllm_connector", ...}'` with the repository on PYTHONPATH
(docs/engine.md). Imports only vLLM, torch and safetensors.
"""

from __future__ import annotations

import fcntl
import json
import os
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import KVCacheConfig

FORMAT = "dflash-hidden-states/1"


def refused_settings(vllm_config: VllmConfig) -> list[str]:
    """The engine settings under which some of a request's hidden states would never be computed, with the flag
    that changes each (empty when none)."""
    refused = []
    if vllm_config.cache_config.enable_prefix_caching:
        refused.append("prefix caching is on (a cached prefix is not recomputed): add --no-enable-prefix-caching")
    if vllm_config.scheduler_config.enable_chunked_prefill:
        refused.append("chunked prefill is on (a document is split over steps): add --no-enable-chunked-prefill "
                       "and --max-num-batched-tokens >= --max-model-len")
    return refused


class DFlashHiddenStatesConnector(ExampleHiddenStatesConnector):
    """vLLM's example hidden-states connector with a device-independent copy, checked settings and metadata."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        refused = refused_settings(vllm_config)
        if refused:
            raise ValueError("DFlashHiddenStatesConnector: " + "; ".join(refused))
        super().__init__(vllm_config, role, kv_cache_config)
        hf = vllm_config.speculative_config.draft_model_config.hf_config
        self._cpu_sent: set[str] = set()  # CPU requests written in this get_finished call
        self._metadata = {
            "format": FORMAT,
            "aux_layer_ids": json.dumps(list(getattr(hf, "eagle_aux_hidden_state_layer_ids", []))),
            "model": str(vllm_config.model_config.model),
            "num_hidden_layers": str(vllm_config.model_config.get_total_num_hidden_layers()),
        }

    def _write_tensors(self, tensors: dict[str, torch.Tensor], event: Any, filename: str,
                       lock_fd: int | None) -> None:
        """Writer thread: waits for the device copy (a CUDA event; None on the CPU), writes the file whole with
        this engine's metadata, then releases the lock."""
        try:
            if event is not None:
                event.synchronize()
            temporary = f"{filename}.{os.getpid()}.tmp"
            save_file(tensors, temporary, metadata=self._metadata)
            os.replace(temporary, filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)

    def _submit_async_write(self, pending: PendingSave) -> None:
        """On CUDA vLLM's own asynchronous copy (a copy stream into pinned memory); elsewhere a synchronous copy to
        host memory, written by the writer thread."""
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        if self._kv_cache.is_cuda:
            super()._submit_async_write(pending)
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (blocks[:, None] * self._block_size + torch.arange(self._block_size)).flatten()
        states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.numel())
        tensors = {"hidden_states": states.clone().contiguous(), "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename) or ".", exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        future = self._executor.submit(self._write_tensors, tensors, None, pending.filename, lock_fd)
        self._req_futures[pending.req_id] = future
        future.add_done_callback(lambda f, req_id=pending.req_id: self._on_write_done(req_id, f))
        self._cpu_sent.add(pending.req_id)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """vLLM's bookkeeping (CUDA copies reported done when their event is), plus the CPU copies, which are done
        when submitted (the copy is synchronous), so their blocks are free at once."""
        self._cpu_sent = set()
        sending, receiving = super().get_finished(finished_req_ids)
        sent = (sending or set()) | self._cpu_sent
        self._accumulated_finished_req_ids -= self._cpu_sent
        return sent or None, receiving
