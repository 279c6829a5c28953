"""The DFlash drafter (docs/method.md section 2): fc + hidden_norm over target features, Qwen3-style layers.

Every layer injects the context as extra keys/values made with its own k/v projections; queries come
from block tokens only. The input embedding and output head are the target's, frozen, held as
non-persistent buffers so that they never enter a checkpoint or an optimizer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from dflash_lightning.blocks import block_input_ids, block_labels, build_block_mask, teacher_positions
from dflash_lightning.config import DrafterConfig
from dflash_lightning.loss import LossSettings, chunked_head_loss, rank_mean_weight
from dflash_lightning.parts.base import HeadOutput, Part, PartOutput, TrainInputs


class RMSNorm(nn.Module):
    """Qwen3's RMSNorm: normalise in fp32, scale in the input dtype (fp32 master weights stay out of bf16 compute)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.to(dtype) * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """RoPE with the target's settings; cos/sin are computed from positions on the fly."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        inv_freq, self.scaling = rope_inv_freq(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin for integer positions `[N]`.  # [N, head_dim] each"""
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


def rope_inv_freq(config: DrafterConfig) -> tuple[Tensor, float]:
    """Inverse frequencies and attention scaling for the configured RoPE type (HF conventions)."""
    dim = config.head_dim
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)), 1.0
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = Qwen3Config(
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        head_dim=dim,
        max_position_embeddings=config.max_position_embeddings,
        rope_theta=config.rope_theta,
        rope_scaling={**scaling, "rope_type": rope_type},
    )
    params = getattr(hf, "rope_parameters", None)
    if isinstance(params, dict):  # transformers 5 folds theta into rope_parameters
        params.setdefault("rope_theta", config.rope_theta)
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, None)
    return inv_freq.float(), float(attention_scaling)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate `x [N, heads, D]` by positions' cos/sin `[N, D]` (rotate-half convention)."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Grouped-query attention of block queries over [context K/V; block K/V]."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        bias = config.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=bias)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def query(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Rotated, normed queries of block tokens.  # [N, heads, D]"""
        q = self.q_norm(self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim)))
        return apply_rope(q, cos, sin)

    def key_value(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """Rotated, normed keys and values of context vectors or block tokens.  # [N, kv_heads, D] each"""
        k = self.k_norm(self.k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim)))
        v = self.v_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        return apply_rope(k, cos, sin), v

    def forward(
        self, x: Tensor, context: Tensor, rope_block: tuple[Tensor, Tensor], rope_context: tuple[Tensor, Tensor],
        block_mask: BlockMask | Tensor,
    ) -> Tensor:
        """Training attention of all blocks `x [A*B, H]` over the packed context `[T, H]`."""
        q = self.query(x, *rope_block)
        k_ctx, v_ctx = self.key_value(context, *rope_context)
        k_blk, v_blk = self.key_value(x, *rope_block)
        k = torch.cat([k_ctx, k_blk]).transpose(0, 1)[None]  # [1, kv_heads, T + A*B, D]
        v = torch.cat([v_ctx, v_blk]).transpose(0, 1)[None]
        out = masked_attention(q.transpose(0, 1)[None], k, v, block_mask)  # [1, heads, A*B, D]
        return self.o_proj(out[0].transpose(0, 1).flatten(1))

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
        """Dense attention of `q [N, heads, D]` over `k, v [M, kv_heads, D]`, all or `mask [N, M]` (serving path)."""
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask,
            enable_gqa=True,
        )
        return self.o_proj(out[0].transpose(0, 1).flatten(1))


def masked_attention(q: Tensor, k: Tensor, v: Tensor, mask: BlockMask | Tensor, scale: float | None = None) -> Tensor:
    """flex_attention of `[1, heads, N, D]` under a BlockMask; on CUDA outside a compiled region the kernel itself
    is compiled (never unfused). A dense boolean mask (the CPU form of the same mask) goes through SDPA instead."""
    if isinstance(mask, Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    if q.is_cuda and not torch.compiler.is_compiling():
        return _compiled_flex()(q, k, v, block_mask=mask, scale=scale, enable_gqa=True)
    return flex_attention(q, k, v, block_mask=mask, scale=scale, enable_gqa=True)


_COMPILED_FLEX = None


def _compiled_flex():
    global _COMPILED_FLEX
    if _COMPILED_FLEX is None:
        _COMPILED_FLEX = torch.compile(flex_attention, dynamic=False)
    return _COMPILED_FLEX


class MLP(nn.Module):
    """SwiGLU feed-forward."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm Qwen3 layer; the context skips input_layernorm and the MLP. A part may wrap each sublayer of the
    block tokens (`Part.layer_modules`: the block convolutions, docs/method.md section 10)."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)
        self.wrappers: dict[str, str] = {}  # sublayer -> the attribute of the part's module around it
        for part in config.preset.parts:
            for sublayer, (name, module) in part.layer_modules(config).items():
                if sublayer in self.wrappers:
                    raise ValueError(f"two parts wrap the {sublayer} of a layer: {self.wrappers[sublayer]}, {name}")
                self.add_module(name, module)
                self.wrappers[sublayer] = name

    def block_forward(self, x: Tensor, attend: Callable[[Tensor], Tensor]) -> Tensor:
        """The layer over block tokens `x [A*B, H]`; `attend` maps normed block tokens to the attention's output."""
        x = x + self._sublayer("attention", self.input_layernorm(x), attend)
        return x + self._sublayer("mlp", self.post_attention_layernorm(x), self.mlp)

    def _sublayer(self, sublayer: str, x: Tensor, fn: Callable[[Tensor], Tensor]) -> Tensor:
        name = self.wrappers.get(sublayer)
        return fn(x) if name is None else getattr(self, name)(x, fn)

    def forward(self, x: Tensor, context: Tensor, rope_block, rope_context, block_mask: BlockMask | Tensor) -> Tensor:
        return self.block_forward(x, lambda h: self.self_attn(h, context, rope_block, rope_context, block_mask))


@dataclass
class DraftOutput:
    """What one training forward returns; `topk` is None unless asked for."""

    loss: Tensor
    """The objective, sum(w * objective) / sum(w) (or a part's `loss_denominator`)."""
    ce: Tensor
    """Weighted cross-entropy against the labels, sum(w * CE) / sum(w), whatever the objective (no gradient)."""
    weights: Tensor
    """Loss weight of every slot this step (D-PACE: from this step's CE).  # [A, B]"""
    supervised: Tensor
    """Slots that count: a valid anchor, k >= 1 (anchor-first: k >= 0, a prefix), label in the loss mask and the
    anchor's document.  # [A, B]"""
    labels: Tensor
    """Target token of every slot.  # [A, B]"""
    topk: Tensor | None
    """Top-k predicted tokens of every slot, best first.  # [A, B, k]"""
    parts: dict[str, PartOutput] = field(default_factory=dict)
    """Each part's results (its logs and metric inputs), by the part's name."""
    hidden: Tensor | None = None
    """Final-normed hidden state of every slot, with its graph (the OPD stage drafts from it).  # [A, B, H]"""


class DFlashDrafter(nn.Module):
    """A DFlash drafter; its state dict holds exactly the exported weights (docs/method.md section 7)."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        assert config.target_layer_ids is not None and config.mask_token_id is not None, "resolve config first"
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(config.num_context_layers * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.parts: tuple[Part, ...] = tuple(part(config) for part in config.preset.parts)
        """The parts of the variant's preset (parts/presets.py), each in its place (`Part.attach`)."""
        for part in self.parts:
            part.attach(self)
        self.rotary = RotaryEmbedding(config)
        # The target's embedding and head rows, frozen and never saved: set by `set_target_io`.
        self.register_buffer("embed_weight", None, persistent=False)
        self.register_buffer("head_weight", None, persistent=False)
        self.head_fp8: tuple[Tensor, Tensor] | None = None  # the head and its transpose in FP8 (`use_fp8_head`)
        self.head_chunk_size = 4096
        self.loss_settings = LossSettings()
        self.head_loss = chunked_head_loss
        self.reset_parameters()

    def compile_blocks(self, mode: str | None = None) -> None:
        """Compile each decoder layer in place (one graph serves all of them), the head loss and each part's own
        training work (`Part.compile_hooks`).

        Per-layer graphs compile about n times faster than one graph of the whole drafter and
        keep state-dict keys free of `_orig_mod.`.
        """
        for layer in self.layers:
            layer.compile(mode=mode, dynamic=False)
        if type(self.fc) is not nn.Linear:  # torchao's float8 linear: its casts fuse only when compiled
            self.fc.compile(mode=mode, dynamic=False)
        self.head_loss = torch.compile(chunked_head_loss, mode=mode, dynamic=False)
        for part in self.parts:
            part.compile_hooks(mode)

    def reset_parameters(self, std: float = 0.02) -> None:
        """Initialise linear layers as Hugging Face does (normal, std 0.02) and norms to one."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        for part in self.parts:  # each part's own initialisation (identity convolutions, normal codebooks ...)
            part.reset_parameters()

    def set_target_io(self, embed_weight: Tensor, head_weight: Tensor) -> None:
        """Attach the target's frozen input embedding `[V, H]` and output head `[V, H]`."""
        expected = (self.config.vocab_size, self.config.hidden_size)
        for name, w in (("embedding", embed_weight), ("head", head_weight)):
            if tuple(w.shape) != expected:
                raise ValueError(f"target {name} has shape {tuple(w.shape)}, the drafter expects {expected}")
        self.embed_weight = embed_weight.detach()
        self.head_weight = head_weight.detach()

    def use_fp8_head(self, recipe: str = "rowwise") -> None:
        """Run the training loss's head matmuls in FP8: the frozen head is quantized once, here."""
        from dflash_lightning.fp8 import quantize_frozen

        head = self.head_weight
        self.head_fp8 = (quantize_frozen(head, recipe), quantize_frozen(head.T.contiguous(), recipe))

    def compute_dtype(self) -> torch.dtype:
        """The dtype activations run in: autocast's (bf16 compute over fp32 master weights), else the weights'."""
        device = self.fc.weight.device.type
        if torch.is_autocast_enabled(device):
            return torch.get_autocast_dtype(device)
        return self.fc.weight.dtype

    def context(self, features: Tensor) -> Tensor:
        """Context vectors `c` from concatenated target features `[T, K*H]`.  # [T, H]"""
        return self.hidden_norm(self.fc(features.to(self.compute_dtype())))

    def embed(self, ids: Tensor) -> Tensor:
        """Target embedding of token ids, in the compute dtype."""
        return F.embedding(ids, self.embed_weight).to(self.compute_dtype())

    def block_hidden(
        self, features: Tensor, input_ids: Tensor, position_ids: Tensor, doc_ids: Tensor,
        anchors: Tensor, anchor_valid: Tensor,
    ) -> Tensor:
        """Final-normed hidden state of every slot of every anchor's block.  # [A, B, H]"""
        return self._blocks(features, input_ids, position_ids, doc_ids, anchors, anchor_valid)[0]

    def _blocks(
        self, features: Tensor, input_ids: Tensor, position_ids: Tensor, doc_ids: Tensor,
        anchors: Tensor, anchor_valid: Tensor,
    ) -> tuple[Tensor, Tensor]:
        """`block_hidden` and the context vectors it attended to.  # [A, B, H], [T, H]"""
        B = self.config.block_size
        context = self.context(features)  # [T, H]
        x = self.embed(block_input_ids(input_ids, anchors, B, self.config.mask_token_id)).flatten(0, 1)  # [A*B, H]
        pos_block = (position_ids[anchors][:, None] + torch.arange(B, device=anchors.device)).flatten()
        rope_block = self.rotary(pos_block, x.dtype)
        rope_context = self.rotary(position_ids, x.dtype)
        rules = [self.config.attention_rule(i) for i in range(len(self.layers))]
        # One mask per rule (full, sliding), built once per step and shared by the layers of that rule.
        masks = {rule: build_block_mask(doc_ids, anchors, anchor_valid, B, *rule) for rule in dict.fromkeys(rules)}
        for layer, rule in zip(self.layers, rules, strict=True):
            x = layer(x, context, rope_block, rope_context, masks[rule])
        return self.norm(x).unflatten(0, (anchors.numel(), B)), context

    def forward(
        self, features: Tensor, input_ids: Tensor, position_ids: Tensor, doc_ids: Tensor, loss_mask: Tensor,
        anchors: Tensor, anchor_valid: Tensor, slot_weights: Tensor, topk: int = 0,
        final_hidden: Tensor | None = None,
    ) -> DraftOutput:
        """One training forward over a packed batch: blocks, the weighted objective through the chunked frozen head.

        `slot_weights [B]` are `blocks.base_slot_weights`; `final_hidden [T, H]` (the target's final normed
        hidden states) is needed when `loss_settings` distills or a part `needs_final_hidden`. The parts join in
        (parts/base.py): inside the head loop (`head_chunk`) and after it (`loss`).
        """
        B, settings = self.config.block_size, self.loss_settings
        layout = self.config.layout  # which position each slot predicts, which slots train (blocks.BlockLayout)
        first = layout.first_slot
        hidden, context = self._blocks(features, input_ids, position_ids, doc_ids, anchors, anchor_valid)
        labels, weights = block_labels(input_ids, loss_mask, doc_ids, anchors, anchor_valid, slot_weights, layout)
        # The token before each slot's label (slot 1: the anchor), where the target's state that predicts it sits.
        before = teacher_positions(anchors, B, input_ids.numel(), layout)  # [A, B]
        head, head_t = self.head_fp8 or (self.head_weight, None)
        batch = TrainInputs(hidden, context, input_ids, position_ids, doc_ids, anchors, anchor_valid, labels,
                            weights > 0, before, final_hidden, self.embed_weight, self.head_weight, layout)
        in_loop = [(part, part.head_inputs(batch)) for part in self.parts]
        in_loop = tuple((part, rows) for part, rows in in_loop if rows is not None)
        # In section 3's block slot 0 (the anchor, given) has weight 0 under every rule and leaves D-PACE's weights
        # of the others as they are, so it skips the head: A*(B-1) rows, 1/B fewer head FLOPs, still a fixed shape.
        # Anchor-first every slot is trained: A*B rows.
        total, ce, used, top, from_loop = self.head_loss(
            hidden[:, first:].flatten(0, 1), head, labels[:, first:].flatten(), weights[:, first:].flatten(),
            self.head_chunk_size, topk, B - first, settings, final_hidden,
            before[:, first:].flatten() if settings.distills else None, head_t, in_loop,
        )
        weight_sum = rank_mean_weight(used).clamp_min(1e-12)
        own = [d for part in self.parts if (d := part.loss_denominator(batch)) is not None]  # one at most (Preset)
        denominator = rank_mean_weight(own[0]).clamp_min(1e-12) if own else weight_sum
        loss = total / denominator
        heads = {id(part): HeadOutput(logged / denominator, rows)
                 for (part, _), (logged, rows) in zip(in_loop, from_loop, strict=True)}
        outputs = {}
        for part in self.parts:
            out = part.loss(batch, heads.get(id(part)), settings)
            if out.loss is not None:
                loss = loss + out.loss
            outputs[part.name] = out
        return DraftOutput(
            loss=loss, ce=ce / weight_sum, weights=_with_slot_0(used.view(-1, B - first), 0.0, first),
            supervised=weights > 0, labels=labels,
            topk=None if top is None else _with_slot_0(top.unflatten(0, (-1, B - first)), -1, first), parts=outputs,
            hidden=hidden,
        )

    def logits(self, hidden: Tensor) -> Tensor:
        """Full logits through the frozen head (serving and tests, not the training step)."""
        return hidden @ self.head_weight.to(hidden.dtype).T


def _with_slot_0(rows: Tensor, fill: float | int | bool, first: int = 1) -> Tensor:
    """Per-slot results of slots first..B-1 `[A, B-first, ...]` with slot 0 put back as `fill` where it skipped
    the head (`first` 1).  # [A, B, ...]"""
    return torch.cat([torch.full_like(rows[:, :1], fill), rows], 1) if first else rows


__all__ = ["DFlashDrafter", "DraftOutput", "RMSNorm", "apply_rope", "masked_attention"]
