"""FP8 on Hopper-class GPUs through torchao: the device check, the drafter's float8 training linears,
the frozen head's and the frozen target's pre-quantized weights with dynamically scaled activations.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Literal, get_args

import torch
from torch import Tensor, nn

from dflash_lightning.config import ConfigError

# torchao's recipe names, plus FP8 for the forward GEMM only (both backward GEMMs in bf16: the gradients exact)
Recipe = Literal["tensorwise", "rowwise", "rowwise_with_gw_hp", "rowwise_forward_only"]
RECIPES: tuple[str, ...] = get_args(Recipe)
AMAX_FLOOR = 1e-12  # all-zero rows (unsupervised slots' gradients) would get scale 0 and turn into NaN
MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada, Hopper and later


def require_fp8(device: torch.device | str, option: str, off: str | None = None) -> None:
    """Refuse FP8 unless `device` is a CUDA GPU with FP8 tensor cores and torchao is installed; `off`: the flags
    that turn it off, as the refusal names them (default: `option`'s own)."""
    device = torch.device(device)
    off = off or ("--model.fp8=none" if option.startswith("model.") else "--target.fp8=false")
    if device.type != "cuda":
        raise ConfigError(f"{option}: FP8 needs a CUDA GPU with FP8 tensor cores (Hopper), this run is on {device}; "
                          f"train in bf16 with {off}")
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        raise ConfigError(
            f"{option}: FP8 needs compute capability >= 8.9 (Hopper: 9.0), "
            f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}; train in bf16 with {off}"
        )
    try:
        import torchao  # noqa: F401
    except ImportError as err:
        raise ConfigError(f"{option}: FP8 goes through torchao: pip install 'torchao>=0.17'") from err


def _fp8_shaped(module: nn.Module, name: str = "", exempt: tuple[str, ...] = ()) -> bool:
    """FP8 matmuls need both dims divisible by 16; a part's linears named in `exempt` (prefixes: parts whose weights
    the loss reads by hand, as the candidate selector's projection) stay as they are."""
    shaped = isinstance(module, nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0
    return shaped and not any(name == p or name.startswith(p + ".") for p in exempt)


def training_config(recipe: Recipe, emulate: bool = False):
    """torchao's `Float8LinearConfig` of `recipe` (`emulate`: FP8 numerics in high precision, for CPU tests)."""
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.config import CastConfig, ScalingGranularity, ScalingType

    if recipe not in RECIPES:
        raise ConfigError(f"model.fp8_recipe: {recipe!r} is not one of {', '.join(RECIPES)}")
    if recipe != "rowwise_forward_only":
        return dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)
    off = CastConfig(scaling_type=ScalingType.DISABLED)
    return Float8LinearConfig(  # output = x_fp8 @ w_fp8 (per row); grad_input and grad_weight in bf16
        cast_config_input=CastConfig(scaling_granularity=ScalingGranularity.AXISWISE),
        cast_config_weight=CastConfig(scaling_granularity=ScalingGranularity.AXISWISE), cast_config_grad_output=off,
        cast_config_input_for_grad_weight=off, cast_config_weight_for_grad_input=off,
        cast_config_grad_output_for_grad_weight=off, round_scales_to_power_of_2=True, emulate=emulate,
    )


def convert_linears(module: nn.Module, recipe: Recipe, emulate: bool = False) -> nn.Module:
    """Swap `module`'s linear layers for torchao's float8 training linears (parameter names unchanged)."""
    from torchao.float8 import convert_to_float8_training

    exempt = tuple(p.weight_prefix for p in getattr(module, "parts", ()) if p.fp8_exempt)  # a drafter's parts
    return convert_to_float8_training(module, config=training_config(recipe, emulate),
                                      module_filter_fn=lambda m, name: _fp8_shaped(m, name, exempt))


def _granularity(recipe: Recipe):
    from torchao.quantization import PerRow, PerTensor

    return PerTensor() if recipe == "tensorwise" else PerRow()  # the frozen head's scaling


def quantize_frozen(weight: Tensor, recipe: Recipe = "rowwise") -> Tensor:
    """A frozen weight `[out, in]` in FP8 (e4m3, scaled per row or per tensor) for `F.linear(x, w)`.

    Activations multiplied with it are quantized on the fly with the same granularity, as torchao's
    dynamic-activation config does for the target's linears.
    """
    from torchao.float8.inference import Float8MMConfig
    from torchao.quantization import Float8Tensor
    from torchao.quantization.quantize_.workflows import QuantizeTensorToFloat8Kwargs

    granularity = _granularity(recipe)
    return Float8Tensor.from_hp(
        weight.detach(), float8_dtype=torch.float8_e4m3fn, granularity=granularity,
        mm_config=Float8MMConfig(use_fast_accum=True),
        act_quant_kwargs=QuantizeTensorToFloat8Kwargs(torch.float8_e4m3fn, granularity, hp_value_lb=AMAX_FLOOR),
    )


def quantize_model(model: nn.Module, recipe: Recipe = "rowwise") -> nn.Module:
    """A frozen model's linear layers in FP8, weights and dynamically scaled activations (torchao `quantize_`)."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, quantize_

    # Left on, torchao turns on inductor's coordinate-descent tuning (and, in 0.17, TF32 matmuls) process-wide: every
    # later compile, the drafter's too, would then benchmark configurations of each Triton kernel, unasked.
    config = Float8DynamicActivationFloat8WeightConfig(
        granularity=_granularity(recipe), activation_value_lb=AMAX_FLOOR, set_inductor_config=False
    )
    quantize_(model, config, filter_fn=_fp8_shaped)
    return model


def without_fp8(module: nn.Module) -> nn.Module:
    """`module` with torchao's float8 linears as plain linears sharing their weights (what serving runs).

    Modules holding none are returned as they are; the others are shallow copies, so `module` is unchanged.
    """
    if isinstance(module, nn.Linear) and type(module) is not nn.Linear:
        linear = nn.Linear(0, 0, device="meta")
        linear.in_features, linear.out_features = module.in_features, module.out_features
        linear.weight = module.weight
        linear.register_parameter("bias", module.bias)
        return linear
    if all(type(m) is nn.Linear for m in module.modules() if isinstance(m, nn.Linear)):
        return module
    plain = copy.copy(module)
    plain.__dict__["_modules"] = {name: without_fp8(child) for name, child in module._modules.items()}
    plain.__dict__["_compiled_call_impl"] = None  # a compiled module's graph calls the original's forward
    return plain
