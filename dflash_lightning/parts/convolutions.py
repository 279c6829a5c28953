"""Block convolutions (docs/method.md section 10): causal taps over the slots of one block around each sublayer.

Every drafter layer gets two, `attention_conv` and `mlp_conv`; both start as the identity, so a drafter without
them is a valid warm start. DFlash2 and LiLiCorr+conv use them alike (same keys, same `dflash_config` fields).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash_lightning.errors import ConfigError
from dflash_lightning.parts.base import Part

OWN_KEY = re.compile(r"layers\.\d+\.(attention|mlp)_conv\.")


@dataclass
class ConvSettings:
    """Shape of the block convolutions (`model.drafter.conv.*`)."""

    kernel_size: int = 2
    """Taps k of each convolution: slot t reads slots t-k+1..t of its own block (dflash_config conv_kernel_size)."""
    group_size: int = 16
    """Channels g that share one dynamic tap; hidden_size must be divisible by it (dflash_config conv_group_size)."""

    def check(self, config: Any) -> None:
        """Raise ConfigError naming the field of a value that cannot work for the drafter `config`."""
        if not 1 <= self.kernel_size <= config.block_size:
            raise ConfigError(
                f"conv.kernel_size must be in 1..block_size ({config.block_size}), got {self.kernel_size}"
            )
        if self.group_size < 1:
            raise ConfigError(f"conv.group_size must be >= 1 and divide hidden_size, got {self.group_size}")
        if config.hidden_size is not None and config.hidden_size % self.group_size:
            raise ConfigError(f"conv.group_size ({self.group_size}) must divide hidden_size ({config.hidden_size})")


class BlockConv(nn.Module):
    """Causal taps over the slots of one block, with per-slot kernels: `conv(x)[t, c] = sum_tau (b[tau, c] +
    d[t, tau, G(c)]) * x[t - tau, c]` for `t - tau >= 0`; a block never reads another block or the context."""

    def __init__(self, config: Any) -> None:
        """`config`: the drafter's (hidden_size, block_size and the `conv` settings)."""
        super().__init__()
        h, self.k, self.g = config.hidden_size, config.conv.kernel_size, config.conv.group_size
        self.block_size = config.block_size
        self.base_kernel = nn.Parameter(torch.empty(2, self.k, h))  # [2 (in, out), k, H]
        self.kernel_projection = nn.Linear(h, 2 * self.k * (h // self.g), bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The identity: tap 0 of the base kernel 1, every other tap and the projection 0."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def forward(self, x: Tensor, sublayer: Callable[[Tensor], Tensor]) -> Tensor:
        """`conv_out(sublayer(conv_in(x)))` over block tokens `x [A*B, H]` (after the sublayer's input norm)."""
        blocks = x.unflatten(0, (-1, self.block_size))  # [A, B, H]
        d = self.kernel_projection(blocks).unflatten(-1, (2, self.k, -1))  # [A, B, 2, k, H/g]
        inner = sublayer(self.taps(blocks, d[:, :, 0], self.base_kernel[0]).flatten(0, 1))
        return self.taps(inner.unflatten(0, blocks.shape[:2]), d[:, :, 1], self.base_kernel[1]).flatten(0, 1)

    def taps(self, x: Tensor, d: Tensor, base: Tensor) -> Tensor:
        """One convolution of blocks `x [A, B, H]` with dynamic taps `d [A, B, k, H/g]` and base taps `[k, H]`."""
        a, b, h = x.shape
        grouped = (h // self.g, self.g)
        base = base.to(x.dtype).unflatten(-1, grouped)  # [k, H/g, g]
        d = d.to(x.dtype)
        out = torch.zeros_like(x).unflatten(-1, grouped)  # [A, B, H/g, g]
        for tau in range(self.k):
            shifted = F.pad(x, (0, 0, tau, 0))[:, :b].unflatten(-1, grouped)  # slot t reads slot t - tau, 0 before 0
            out = out + (base[tau] + d[:, :, tau, :, None]) * shifted
        return out.flatten(-2)


class BlockConvolutions(Part):
    """The part: a `BlockConv` around the attention and the MLP of every layer (`layers.{i}.{attention,mlp}_conv`).

    Training, metrics and decoding are the backbone's: the convolutions only change its hidden states."""

    name = "conv"
    settings_type = ConvSettings
    legacy_fields: ClassVar[dict[str, str]] = {"conv_kernel_size": "kernel_size", "conv_group_size": "group_size"}
    config_fields: ClassVar[dict[str, str]] = {"conv_kernel_size": "kernel_size", "conv_group_size": "group_size"}
    changes_backbone = True

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.convs: list[BlockConv] = []  # the layers' modules (registered there, not here)

    @classmethod
    def layer_modules(cls, config: Any) -> dict[str, tuple[str, nn.Module]]:
        return {sub: (f"{sub}_conv", BlockConv(config)) for sub in ("attention", "mlp")}

    def attach(self, drafter: nn.Module) -> None:
        self.convs = [m for layer in drafter.layers for m in (layer.attention_conv, layer.mlp_conv)]

    def reset_parameters(self) -> None:
        for conv in self.convs:
            conv.reset_parameters()

    @classmethod
    def owns(cls, key: str) -> bool:
        return OWN_KEY.match(key) is not None


__all__ = ["BlockConv", "BlockConvolutions", "ConvSettings"]
