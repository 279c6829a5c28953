"""Target feature extraction (DFLASH.md sections 1, 4c): the frozen target that returns context features.

Only the target's first `max(layer_ids) + 1` decoder layers are built and run, unless distillation needs its
final normed hidden state (`final_hidden`): then all layers and the final norm. No LM head is built.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from dflash_lightning.target.loading import decoder_layers, resolve_model_dir
from dflash_lightning.target.sharded import sharded_model

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class FeatureExtractor(nn.Module):
    """A frozen target that returns the concatenated outputs of its `layer_ids` (and its final normed state)."""

    def __init__(self, model: nn.Module, layer_ids: list[int], num_target_layers: int,
                 final_hidden: bool = False) -> None:
        super().__init__()
        self.model, self.layer_ids, self.final_hidden = model, list(layer_ids), final_hidden
        self._captured: dict[int | str, Tensor] = {}
        layers = decoder_layers(model)
        # hidden_states[L] in HF numbering is normed: the last layer's feature is the final norm's output.
        last, norm = num_target_layers - 1, getattr(model, "norm", None)
        for j in sorted(set(self.layer_ids)):
            source = norm if j == last and norm is not None else layers[j]
            source.register_forward_hook(self._capture(j))
        if final_hidden:
            if norm is None or len(decoder_layers(model)) != num_target_layers:
                raise ValueError("final_hidden needs the whole target with its final norm (build it untruncated)")
            norm.register_forward_hook(self._capture("final"))
        self.requires_grad_(False).eval()

    @classmethod
    def from_pretrained(
        cls, path: str, layer_ids: list[int], dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu", attn_implementation: str = "sdpa", mesh: DeviceMesh | None = None,
        final_hidden: bool = False,
    ) -> FeatureExtractor:
        """Load only the decoder layers the features need (no LM head); all of them with `final_hidden`.

        With `mesh`, the target is sharded across the mesh's ranks (FSDP2): each rank reads only its rows
        of every weight and holds 1/N of the target; a forward gathers one layer's weights at a time.
        """
        from transformers import AutoConfig, AutoModel
        from transformers.utils import logging as hf_logging

        folder = resolve_model_dir(path)
        config = AutoConfig.from_pretrained(folder)
        text = getattr(config, "text_config", None) or config
        total = text.num_hidden_layers
        keep = total if final_hidden else max(layer_ids) + 1
        truncated = copy.deepcopy(config)
        t_text = getattr(truncated, "text_config", None) or truncated
        t_text.num_hidden_layers = keep
        if isinstance(getattr(t_text, "layer_types", None), list):
            t_text.layer_types = t_text.layer_types[:keep]
        if mesh is not None:
            model = sharded_model(folder, truncated, dtype, attn_implementation, mesh, torch.device(device))
            return cls(getattr(model, "language_model", model), layer_ids, total, final_hidden)
        level = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # the skipped layers and head are expected, not worth a warning
        try:
            model = AutoModel.from_pretrained(
                folder, config=truncated, dtype=dtype, attn_implementation=attn_implementation
            )
        finally:
            hf_logging.set_verbosity(level)
        model = getattr(model, "language_model", model)
        return cls(model, layer_ids, total, final_hidden).to(device)

    def _capture(self, j: int | str):
        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            self._captured[j] = output[0] if isinstance(output, tuple) else output

        return hook

    def forward(self, input_ids: Tensor, position_ids: Tensor) -> Tensor:
        """Context features of a packed row `[T]`.  # [T, K*H]"""
        return self.extract(input_ids, position_ids)["context_features"]

    @torch.no_grad()
    def extract(self, input_ids: Tensor, position_ids: Tensor) -> dict[str, Tensor]:
        """The batch fields of a packed row `[T]` (per-document causal attention): `context_features [T, K*H]`,
        and `final_hidden [T, H]` (the final norm's output) if this extractor makes it."""
        # Positions restarting at 0 mark document starts. For SDPA the per-document causal mask is built
        # here, on the device; left to transformers, finding the documents costs a host sync per forward.
        self._captured.clear()
        mask = None
        if getattr(self.model.config, "_attn_implementation", None) == "sdpa":
            mask = packed_causal_mask(position_ids)[None, None]  # [1, 1, T, T], True = attend
        self.model(input_ids=input_ids[None], position_ids=position_ids[None], attention_mask=mask, use_cache=False)
        if hasattr(self.model, "reshard"):  # a sharded target: free the gathered root weights too
            self.model.reshard()
        out = {"context_features": torch.cat([self._captured[j][0] for j in self.layer_ids], dim=-1)}
        if self.final_hidden:
            out["final_hidden"] = self._captured["final"][0]
        self._captured.clear()
        return out



def packed_causal_mask(position_ids: Tensor) -> Tensor:
    """Causal attention within each document of a packed row whose positions restart at 0.  # [T, T] bool"""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[1:] = position_ids[1:] != position_ids[:-1] + 1
    doc = starts.cumsum(0)
    index = torch.arange(position_ids.numel(), device=position_ids.device)
    return (doc[:, None] == doc[None, :]) & (index[:, None] >= index[None, :])
