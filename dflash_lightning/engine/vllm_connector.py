"""`DFlashHiddenStatesConnector`: vLLM's hidden-states connector that runs on the CPU engine as on CUDA.

vLLM's `extract_hidden_states` speculative method stores each token's auxiliary hidden states in a KV-cache group
of their own; a KV connector takes them out when the request finishes. vLLM 0.32's example connector
(`ExampleHiddenStatesConnector`) does that with CUDA streams, CUDA events and pinned host memory, so on a CPU engine
it fails at the first request. This subclass keeps its scheduler side and file protocol (one safetensors file per
request, its path in the response's `kv_transfer_params`, a `.lock` file held until the file is complete) and
replaces the device copy with one that works on any device. It also refuses, at engine start, the settings under
which a request's features would not all be computed (prefix caching, chunked prefill), and writes the layer ids
and model into each file's metadata so that the trainer checks it reads the features it asked for.

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
    ExampleHiddenStatesConnectorMetadata,
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
        self._metadata = {
            "format": FORMAT,
            "aux_layer_ids": json.dumps(list(getattr(hf, "eagle_aux_hidden_state_layer_ids", []))),
            "model": str(vllm_config.model_config.model),
            "num_hidden_layers": str(vllm_config.model_config.get_total_num_hidden_layers()),
        }

    def _submit_async_write(self, pending: PendingSave) -> None:
        """Copies one finished request's hidden states to host memory now and writes them in a writer thread,
        which releases the request's lock file when the file is complete."""
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (blocks[:, None] * self._block_size + torch.arange(self._block_size)).flatten()
        states = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device), pending.token_ids.numel())
        tensors = {"hidden_states": states.to("cpu", copy=True).contiguous(),  # synchronous: done before return
                   "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename) or ".", exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        future = self._executor.submit(_write, tensors, self._metadata, pending.filename, lock_fd)
        self._req_futures[pending.req_id] = future
        future.add_done_callback(lambda f, req_id=pending.req_id: self._on_write_done(req_id, f))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Writes the requests that finished in this step; their blocks are free to reuse at once (the copy is
        synchronous), so every tracked request is reported done sending in the same call."""
        sent: set[str] = set()
        if self.has_connector_metadata():
            metadata = self._get_connector_metadata()
            if isinstance(metadata, ExampleHiddenStatesConnectorMetadata):
                for pending in metadata.pending_saves:
                    self._submit_async_write(pending)
                    sent.add(pending.req_id)
        for req_id in finished_req_ids:  # aborted before a save: close a pre-created lock so no reader waits on it
            lock_fd = self._lock_fds.pop(req_id, None)
            if lock_fd is not None:
                os.close(lock_fd)
        return sent or None, None


def _write(tensors: dict[str, torch.Tensor], metadata: dict[str, Any], filename: str, lock_fd: int | None) -> None:
    """Writes the file whole (a temporary name, then a rename), then releases the lock."""
    try:
        temporary = f"{filename}.{os.getpid()}.tmp"
        save_file(tensors, temporary, metadata=metadata)
        os.replace(temporary, filename)
    finally:
        if lock_fd is not None:
            os.close(lock_fd)
