"""DFlashModule: compiled and eager steps agree, buffers are fixed-shape, bad configs fail early."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import packed_batch

from dflash_lightning.config import ConfigError, DrafterConfig
from dflash_lightning.module import DFlashModule
from dflash_lightning.target_model import FeatureExtractor


def make_module(target, compile: bool = False, **kw) -> DFlashModule:
    kw = {"token_budget": 64, "num_anchors": 8, **kw}
    module = DFlashModule(str(target), DrafterConfig(num_layers=2, block_size=8), compile=compile, **kw)
    module.configure_model()
    return module


def batch_with_features(target, layer_ids, token_budget=64):
    batch = packed_batch([30, 20] if token_budget >= 50 else [20, 20], token_budget, vocab=50)
    batch["context_features"] = FeatureExtractor.from_pretrained(str(target), layer_ids, torch.float32)(
        batch["input_ids"], batch["position_ids"]
    )
    return batch


def test_compiled_and_eager_give_the_same_loss_and_grads(tiny_target):
    torch.manual_seed(0)
    eager = make_module(tiny_target)
    compiled = make_module(tiny_target, compile=True)
    compiled.load_state_dict(eager.state_dict())
    compiled.configure_model()  # idempotent: a second call changes nothing
    assert list(compiled.state_dict()) == list(eager.state_dict())  # no _orig_mod. in keys
    batch = batch_with_features(tiny_target, eager.drafter_config.target_layer_ids)
    losses, grads = [], []
    for module in (eager, compiled):
        out = module.step(batch, topk=5, generator=torch.Generator().manual_seed(3))
        out.loss.backward()
        losses.append(out.loss.detach())
        grads.append(module.drafter.fc.weight.grad.clone())
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-5)
    assert losses[0] > 0


@pytest.mark.parametrize("objective,loss_weights", [("kl", "decay"), ("ce+kl", "dpace")])  # ce: the test above
def test_compiled_and_eager_agree_for_each_objective(tiny_target, objective, loss_weights):
    kw = {"objective": objective, "loss_weights": loss_weights, "temperature": 1.5, "head_chunk_size": 20}
    torch.manual_seed(0)
    eager = make_module(tiny_target, **kw)
    compiled = make_module(tiny_target, compile=True, **kw)
    compiled.load_state_dict(eager.state_dict())
    assert all(layer._compiled_call_impl is not None for layer in compiled.drafter.layers)  # compile did happen
    assert all(layer._compiled_call_impl is None for layer in eager.drafter.layers)
    batch = batch_with_features(tiny_target, eager.drafter_config.target_layer_ids)
    batch["final_hidden"] = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    outs = [m.step(batch, generator=torch.Generator().manual_seed(3)) for m in (eager, compiled)]
    for out in outs:
        out.loss.backward()
    torch.testing.assert_close(outs[0].loss, outs[1].loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[0].weights, outs[1].weights, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(eager.drafter.fc.weight.grad, compiled.drafter.fc.weight.grad, rtol=1e-4, atol=1e-5)
    assert torch.equal(outs[0].loss.detach(), outs[0].ce) == (objective == "ce")


def test_distilling_without_the_targets_final_hidden_states_is_refused(tiny_target):
    module = make_module(tiny_target, objective="kl")
    batch = batch_with_features(tiny_target, module.drafter_config.target_layer_ids)
    with pytest.raises(RuntimeError, match="objective 'kl' needs the target's final hidden states"):
        module.step(batch)


def test_compile_cache_dir_points_inductor_at_a_persistent_folder(tiny_target, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "elsewhere")  # restored after the test
    make_module(tiny_target, compile=True, compile_cache_dir=str(tmp_path / "cache"))
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache")


def test_batch_of_wrong_shape_is_refused(tiny_target):
    module = make_module(tiny_target)
    batch = batch_with_features(tiny_target, module.drafter_config.target_layer_ids, token_budget=48)
    with pytest.raises(ValueError, match="input_ids.*expected \\(64,\\)"):
        module.step(batch)


def test_checkpoint_has_only_drafter_weights(tiny_target):
    module = make_module(tiny_target)
    keys = set(module.state_dict())
    assert "drafter.fc.weight" in keys and "drafter.layers.1.mlp.down_proj.weight" in keys
    assert not any("embed" in k or "head" in k or "buffers_" in k for k in keys)


@pytest.mark.parametrize("drafter,kw,message", [
    (DrafterConfig(hidden_size=32), {}, "hidden_size \\(32\\) must equal the target's hidden_size \\(64\\)"),
    (DrafterConfig(target_layer_ids=[1, 6]), {}, "target_layer_ids \\[6\\] out of range"),
    (DrafterConfig(target_layer_ids=[1, 5]), {}, "name the target's last layer \\(5\\): the engines disagree"),
    (DrafterConfig(mask_token_id=999), {}, "mask_token_id 999 is outside the target's embedding"),
    (DrafterConfig(mask_token_id=5), {}, "mask_token_id 5 is a token the tokenizer emits"),
    (DrafterConfig(block_size=1), {}, "block_size must be >= 2"),
    (DrafterConfig(block_size=16), {"token_budget": 8}, "token_budget \\(8\\) must be >= block_size \\(16\\)"),
    (DrafterConfig(), {"num_anchors": 0}, "num_anchors must be in 1..token_budget"),
    (DrafterConfig(block_size=12), {}, "gamma: no default for block_size 12"),
    (DrafterConfig(num_layers=2, layer_types=["sliding_attention"], sliding_window=8), {},
     "layer_types has 1 entries, the drafter has num_layers=2"),
    (DrafterConfig(layer_types=["sliding"], sliding_window=8), {}, r"layer_types: unknown type\(s\) \['sliding'\]"),
    (DrafterConfig(layer_types=["sliding_attention"]), {}, "sliding_window must be >= 1 for sliding_attention"),
    (DrafterConfig(sliding_window=8), {}, "sliding_window \\(8\\) is set but no layer is sliding_attention"),
    (DrafterConfig(), {"num_anchors": 8, "objective": "kd"}, "objective must be one of"),
    (DrafterConfig(), {"num_anchors": 8, "loss_weights": "pace"}, "loss_weights must be one of"),
    (DrafterConfig(), {"num_anchors": 8, "dpace_alpha": 1.5}, "dpace_alpha must be in \\[0, 1\\]"),
    (DrafterConfig(), {"num_anchors": 8, "temperature": 0.0}, "temperature must be > 0"),
])
def test_bad_configs_fail_before_any_compute(tiny_target, drafter, kw, message):
    with pytest.raises(ConfigError, match=message):
        DFlashModule(str(tiny_target), drafter, **{"token_budget": 64, "num_anchors": 8, **kw})


def test_missing_target_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no model folder at"):
        DFlashModule(str(tmp_path / "nope"))


def test_norm_clipping_goes_through_fsdps_own_clip_grad_norm(tiny_target):
    """Lightning refuses norm clipping under FSDP; the module hands it to the wrapped model's clip_grad_norm_."""
    import math
    from types import SimpleNamespace

    module = make_module(tiny_target)
    params = [p for p in module.drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, fused=True)
    calls = []
    fsdp_like = SimpleNamespace(clip_grad_norm_=lambda max_norm: calls.append(max_norm) or torch.tensor(2.0))
    module._trainer = SimpleNamespace(model=fsdp_like, world_size=1)
    module.clip_gradients = lambda optimizer, gradient_clip_val, gradient_clip_algorithm: calls.append(
        ("lightning", gradient_clip_val, gradient_clip_algorithm)
    )
    module.configure_gradient_clipping(optimizer, 1.0, "norm")
    module.configure_gradient_clipping(optimizer, 1.0, "value")  # not a norm: Lightning's; the norm only measured
    assert calls == [1.0, ("lightning", 1.0, "value"), math.inf]
    module._trainer = SimpleNamespace(model=torch.nn.Linear(1, 1), world_size=1)  # DDP / one device
    for p in params:
        p.grad = torch.randn_like(p)
    reference = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for r, p in zip(reference, params, strict=True):
        r.grad = p.grad.clone()
    torch.nn.utils.clip_grad_norm_(reference, 1.0)
    module.configure_gradient_clipping(optimizer, 1.0, "norm")  # clipped here, as torch's clip_grad_norm_ does
    for r, p in zip(reference, params, strict=True):
        torch.testing.assert_close(p.grad, r.grad)
    assert float(optimizer.found_inf) == 0.0
