"""Target feature extraction (docs/method.md sections 1, 4c): the frozen target that returns context features.

Only the target's first `max(layer_ids) + 1` decoder layers are built and run, unless distillation needs its
final normed hidden state (`final_hidden`): then all layers and the final norm. No LM head is built.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask

from dflash_lightning.blocks import interval_block_mask
from dflash_lightning.config import ConfigError
from dflash_lightning.model import masked_attention
from dflash_lightning.target_model.loading import decoder_layers, resolve_model_dir
from dflash_lightning.target_model.sharded import sharded_model

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
        types = list(getattr(model.config, "layer_types", None) or [])[: len(layers)]
        sliding = [i for i, kind in enumerate(types) if kind != "full_attention"]
        if sliding:  # one per-document causal mask serves every layer here: a window would be ignored
            raise ConfigError(f"target: layers {sliding} are {types[sliding[0]]!r}; features of targets with "
                              "sliding-window layers would not match what they serve, and are not supported")
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

    def quantize_fp8(self) -> FeatureExtractor:
        """The target's linear layers in FP8 (rowwise-scaled weights and activations, torchao), on its device."""
        from dflash_lightning.fp8 import quantize_model

        quantize_model(self.model, "rowwise")
        return self

    @staticmethod
    def check_compile_device(device: torch.device | str) -> None:
        """Refuse `target.compile` off CUDA (before the target loads): the CPU runs the target eager."""
        if torch.device(device).type != "cuda":
            raise ConfigError(f"target.compile: compiles the target's layers on CUDA GPUs, the target is on {device}; "
                              "drop target.compile (the CPU runs the target eager)")

    def compile_layers(self) -> FeatureExtractor:
        """Compile each decoder layer in place (one graph serves all of them, the row's shape is fixed).

        Eager, an FP8 target pays a separate kernel for every activation's scale and cast; compiled, they fuse.
        """
        for layer in decoder_layers(self.model):
            layer.compile(dynamic=False)
        return self

    @classmethod
    def from_pretrained(
        cls, path: str, layer_ids: list[int], dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu", attn_implementation: str = "auto", mesh: DeviceMesh | None = None,
        final_hidden: bool = False,
    ) -> FeatureExtractor:
        """Load only the decoder layers the features need (no LM head); all of them with `final_hidden`.

        With `mesh`, the target is sharded across the mesh's ranks (FSDP2): each rank reads only its rows
        of every weight and holds 1/N of the target; a forward gathers one layer's weights at a time.
        `attn_implementation` "auto" is `packed_flex` on CUDA and `sdpa` elsewhere (`attention_for`).
        """
        from transformers import AutoConfig, AutoModel
        from transformers.utils import logging as hf_logging

        attn_implementation = attention_for(attn_implementation, torch.device(device))

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

    @property
    def dense_mask(self) -> bool | None:
        """The attention mask this target takes: dense `[1, 1, T, T]` (SDPA) or a BlockMask (flex attention); None:
        neither, transformers builds its own causal mask."""
        implementation = getattr(self.model.config, "_attn_implementation", None)
        if implementation in (PACKED_FLEX, "flex_attention"):
            return False
        return True if implementation == "sdpa" else None

    @torch.no_grad()
    def extract(self, input_ids: Tensor, position_ids: Tensor, mask: Tensor | BlockMask | None = None
                ) -> dict[str, Tensor]:
        """The batch fields of a packed row `[T]` (per-document causal attention, or `mask` of the kind
        `dense_mask` names): `context_features [T, K*H]`, and `final_hidden [T, H]` (the final norm's output) if
        this extractor makes it."""
        # Positions restarting at 0 mark document starts. The per-document causal mask is built here, on the
        # device; left to transformers, finding the documents costs a host sync per forward.
        self._captured.clear()
        if mask is None and self.dense_mask is False:
            mask = packed_causal_block_mask(position_ids)  # tiles only: no [T, T] tensor
        elif mask is None and self.dense_mask:
            mask = packed_causal_mask(position_ids)[None, None]  # [1, 1, T, T], True = attend
        self.model(input_ids=input_ids[None], position_ids=position_ids[None], attention_mask=mask, use_cache=False)
        if hasattr(self.model, "reshard"):  # a sharded target: free the gathered root weights too
            self.model.reshard()
        out = {"context_features": torch.cat([self._captured[j][0] for j in self.layer_ids], dim=-1)}
        if self.final_hidden:
            out["final_hidden"] = self._captured["final"][0]
        self._captured.clear()
        return out

    def final_states(self, input_ids: Tensor, position_ids: Tensor, mask: Tensor | BlockMask) -> Tensor:
        """The final normed hidden states of a sequence `[N]` under `mask` (Draft-OPD's replay, opd.py).  # [N, H]"""
        if not self.final_hidden:
            raise ValueError("final_states needs the whole target with its final norm (built with final_hidden)")
        return self.extract(input_ids, position_ids, mask)["final_hidden"]


def packed_documents(position_ids: Tensor) -> Tensor:
    """Document number of every token of a packed row whose positions restart at 0 (or jump).  # [T]"""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[1:] = position_ids[1:] != position_ids[:-1] + 1
    return starts.cumsum(0)


def packed_causal_mask(position_ids: Tensor) -> Tensor:
    """Causal attention within each document of a packed row whose positions restart at 0.  # [T, T] bool"""
    doc = packed_documents(position_ids)
    index = torch.arange(position_ids.numel(), device=position_ids.device)
    return (doc[:, None] == doc[None, :]) & (index[:, None] >= index[None, :])


def packed_causal_block_mask(position_ids: Tensor, tile: int = 128) -> BlockMask:
    """The BlockMask of `packed_causal_mask`, from each token's key range [start of its document, itself].

    It holds (T / tile)^2 tile entries, built through a [T, T / tile] count: 32 MB at a 32K-token row, where the
    dense mask is 1 GB.
    """
    doc = packed_documents(position_ids)
    index = torch.arange(doc.numel(), device=doc.device)
    doc_start = torch.cummax(torch.where(doc != torch.roll(doc, 1), index, 0), 0).values  # [T] (index 0 starts)

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx)

    return interval_block_mask([(doc_start, index + 1)], doc.numel(), tile, mask_mod)


# transformers attention name of `packed_flex_attention` ("flash" must not be in it: transformers reads that as FA).
PACKED_FLEX = "packed_flex"


def packed_flex_attention(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: BlockMask,
    scaling: float | None = None, dropout: float = 0.0, **kwargs: Any,
) -> tuple[Tensor, None]:
    """A transformers attention function: flex attention of `[1, heads, T, D]` under the packed row's BlockMask.

    The kernel is the drafter's own (`masked_attention`: compiled on CUDA, eager on the CPU, forward only here).
    """
    out = masked_attention(query, key, value, attention_mask, scale=scaling)
    return out.transpose(1, 2).contiguous(), None  # [1, T, heads, D], as transformers' own backends return


def attention_for(attn_implementation: str, device: torch.device) -> str:
    """The transformers attention backend to load: "auto" is `packed_flex` on CUDA (a BlockMask of the row's
    documents, no `[T, T]` mask), `sdpa` elsewhere (a dense mask: flex has no fast CPU kernel)."""
    from transformers import AttentionInterface

    if PACKED_FLEX not in AttentionInterface._global_mapping:
        AttentionInterface.register(PACKED_FLEX, packed_flex_attention)
    if attn_implementation == "auto":
        return PACKED_FLEX if device.type == "cuda" else "sdpa"
    return attn_implementation
