"""The `TargetFeatures` callback: owns the frozen target in its placement and adds features to each batch.

The target never enters the LightningModule or its checkpoint.
"""

from __future__ import annotations

import inspect
import math
import urllib.parse
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor

from dflash_lightning.config import ConfigError
from dflash_lightning.fp8 import require_fp8
from dflash_lightning.target_model.engine import (
    EngineClient,
    EngineExtractor,
    EngineProcess,
    aux_layer_ids,
    final_norm,
    wait_ready,
)
from dflash_lightning.target_model.features import FeatureExtractor
from dflash_lightning.target_model.loading import DTYPES, load_target_config
from dflash_lightning.target_model.separate import FeaturePrefetcher, rank_devices
from dflash_lightning.target_model.sharded import node_mesh
from dflash_lightning.target_model.wiring import check_wiring

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class TargetFeatures(Callback):
    """Owns the frozen target and puts each batch's context features (and final hidden states) into it."""

    def __init__(
        self,
        path: str,
        dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16",
        placement: Literal["colocated", "separate", "sharded", "engine"] = "colocated",
        target_devices: list[str] | None = None,
        prefetch: int = 2,
        attn_implementation: str = "auto",
        fp8: bool = False,
        compile: bool = False,
        layer_ids: list[int] | None = None,
        final_hidden: bool = False,
        token_budget: int | None = None,
        feature_cache: str | None = None,
        engine_urls: list[str] | None = None,
        engine_command: str | None = None,
        engine_streams: int = 2,
        engine_request_timeout_s: float = 120.0,
        engine_deadline_s: float = 600.0,
        engine_startup_s: float = 900.0,
    ) -> None:
        """
        Args:
            path: Hugging Face model folder or hub id of the target.
            dtype: Dtype the target runs in.
            placement: `colocated`: the target runs on the trainer's own device, features never leave it;
                `separate`: copies of the target on `target_devices` compute features ahead in threads;
                `sharded`: one target sharded over the node's trainer GPUs (for a target too large for one),
                each rank running its own batch through it; `engine`: running vLLM engines at `engine_urls`
                compute them (docs/engine.md), ahead of the trainer like `separate`.
            target_devices: Devices of the target copies for `separate` (e.g. [cuda:2, cuda:3]); with several
                trainer devices per node they are dealt out among the node's ranks (see `rank_devices`).
            prefetch: Batches each separate target may compute ahead of the trainer (a bounded queue).
            attn_implementation: transformers attention backend of the target: `auto` (flex attention under a
                BlockMask of the packed row's documents on GPUs, no `[T, T]` mask; SDPA with a dense mask on the
                CPU), or one of transformers' own (sdpa, eager, flex_attention).
            fp8: Run the target's linear layers in FP8 (Hopper GPUs, torchao: weights and activations scaled per
                row), loaded from `dtype` weights; the features then match a target served in FP8.
            compile: Compile the target's decoder layers (CUDA, placements colocated and separate): the norms,
                RoPE and, with `fp8`, the activations' scales and casts fuse into a few kernels per layer.
            layer_ids: Target layers whose hidden states are the context features: the drafter's
                `target_layer_ids` (linked from the model in the CLI).
            final_hidden: Also give the target's final normed hidden states, distillation's teacher (linked: whether
                `model.objective` distills).
            token_budget: Tokens of the warm-up row of a separate target (linked from `data.token_budget`).
            feature_cache: The data module's feature cache (linked from `data.feature_cache`): with one, no target
                is loaded, the cache serves the features.
            engine_urls: For `engine`: the engines' OpenAI base URLs (http://host:port/v1); the trainer ranks deal them
                out like `target_devices` (several ranks share one engine, or each has its own).
            engine_command: For `engine`: a shell command that starts the engine (`vllm serve ...`, docs/engine.md);
                the first rank starts it, every rank waits for it, and it is stopped when `fit` ends. Unset: the
                engines are started by the user.
            engine_streams: Rows each rank keeps in flight at each of its engines (each row's documents go at once).
            engine_request_timeout_s: Seconds one request may take before it is retried (> 0).
            engine_deadline_s: Seconds of failed tries (a dead, hung or malformed engine) before `fit` stops (> 0).
            engine_startup_s: Seconds to wait for the engines to answer at the start (> 0).
        """
        check_target_settings(**locals())  # every argument, before anything is built
        self.path, self.dtype, self.placement, self.attn_implementation = path, dtype, placement, attn_implementation
        self.target_devices, self.prefetch, self.fp8 = list(target_devices or []), prefetch, fp8
        self.compile = compile
        self.layer_ids = list(layer_ids) if layer_ids is not None else None
        self.final_hidden, self.token_budget, self.feature_cache = final_hidden, token_budget, feature_cache
        self.engine_urls, self.engine_streams = list(engine_urls or []), engine_streams
        self.engine_timeouts = (engine_request_timeout_s, engine_deadline_s, engine_startup_s)
        self.engine = EngineProcess(engine_command, Path("engine.log")) if engine_command else None
        self.extractor: FeatureExtractor | None = None
        self.extractors: list[Any] = []
        self.prefetchers: list[FeaturePrefetcher] = []

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.extractor is not None or self.extractors:
            return
        if hasattr(pl_module, "drafter_config"):  # values given by hand must agree with the module's
            data = trainer.datamodule if hasattr(trainer.datamodule, "target_layer_ids") else None  # a DFlashDataModule
            check_wiring(pl_module, data, self)
        if self.feature_cache:
            return  # the data module serves cached context features; no target is needed
        if self.layer_ids is None:
            raise ConfigError("target.layer_ids: not given; pass the drafter's target_layer_ids "
                              "(TargetFeatures(..., layer_ids=module.drafter_config.target_layer_ids))")
        layer_ids = self.layer_ids
        final = self.final_hidden  # distillation's teacher, the final normed hidden state: then the whole target runs

        if self.placement == "engine":
            self.extractors = self.engine_extractors(trainer, layer_ids, final)
            self.prefetch_loaders(trainer)
            return
        devices = [trainer.strategy.root_device] if self.placement != "separate" else self.target_devices
        for device in devices:  # before any weight is read
            if self.fp8:
                require_fp8(device, "target.fp8")
            if self.compile:
                FeatureExtractor.check_compile_device(device)
        if self.placement == "colocated":
            self.extractor = self.load_extractor(trainer.strategy.root_device, layer_ids, final_hidden=final)
            return
        if self.placement == "sharded":
            mesh = node_mesh(trainer)
            self.extractor = self.load_extractor(trainer.strategy.root_device, layer_ids, mesh, final_hidden=final)
            return
        devices = rank_devices(self.target_devices, trainer.local_rank, trainer.num_devices)
        self.extractors = [self.load_extractor(d, layer_ids, final_hidden=final) for d in devices]
        for extractor in self.extractors:  # compile a GPU target's flex kernel here, never in a prefetch thread
            warm_up(extractor, self.token_budget)
        self.prefetch_loaders(trainer)

    def prefetch_loaders(self, trainer: Trainer) -> None:
        """The data module's loaders, wrapped so that `self.extractors` compute each batch's features ahead."""
        datamodule, device = trainer.datamodule, trainer.strategy.root_device
        for name in ("train_dataloader", "val_dataloader"):
            if not is_overridden(name, datamodule):  # a data module without validation keeps it that way
                continue
            make = getattr(datamodule, name)
            setattr(datamodule, name, lambda make=make: self.prefetched(make(), device))

    def engine_extractors(self, trainer: Trainer, layer_ids: list[int], final: bool) -> list[EngineExtractor]:
        """This rank's engines' extractors (`engine_streams` each), once every engine answers; `fit` starts the
        engine first when given its command (on the first rank, its log beside the run's)."""
        config = load_target_config(self.path)
        total, hidden = config.num_hidden_layers, config.hidden_size
        timeout, deadline, startup = self.engine_timeouts
        if self.engine is not None and trainer.global_rank == 0:
            self.engine.log = Path(trainer.default_root_dir) / "engine.log"
            self.engine.start()
        urls = rank_devices(self.engine_urls, trainer.global_rank, trainer.world_size)
        clients = [EngineClient(url, aux_layer_ids(layer_ids, total, final), hidden, timeout, deadline) for url in urls]
        wait_ready(clients, self.engine if trainer.global_rank == 0 else None, startup)
        norm = final_norm(self.path, DTYPES[self.dtype]) if final else None
        dtype = DTYPES[self.dtype]
        return [EngineExtractor(c, layer_ids, dtype, norm) for c in clients for _ in range(self.engine_streams)]

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        for prefetcher in self.prefetchers:  # its threads are joined before the interpreter exits
            prefetcher.close()
        self.prefetchers.clear()
        if self.engine is not None:
            self.engine.stop()

    def load_extractor(
        self, device: torch.device | str, layer_ids: list[int], mesh: DeviceMesh | None = None,
        final_hidden: bool = False,
    ) -> FeatureExtractor:
        """The target's feature extractor on `device` (sharded over `mesh` when given; in FP8 and compiled if asked)."""
        extractor = FeatureExtractor.from_pretrained(
            self.path, layer_ids, DTYPES[self.dtype], device, self.attn_implementation, mesh, final_hidden
        )
        if self.fp8:
            extractor.quantize_fp8()
        return extractor.compile_layers() if self.compile else extractor

    def prefetched(self, loader: Any, device: torch.device) -> Any:
        """`loader` with features computed ahead by the separate targets (empty loaders pass through)."""
        if isinstance(loader, (list, tuple)) and not loader:
            return loader
        prefetcher = FeaturePrefetcher(loader, self.extractors, device, self.prefetch)
        self.prefetchers.append(prefetcher)
        return prefetcher

    def add_features(self, batch: dict[str, Tensor]) -> None:
        """Write `context_features [T, K*H]` (and `final_hidden [T, H]`) unless a separate target already did."""
        if "context_features" in batch:
            return
        if self.extractor is None:
            raise RuntimeError("TargetFeatures: a batch arrived without features and no target is on this device")
        batch.update(self.extractor.extract(batch["input_ids"], batch["position_ids"]))

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self.add_features(batch)

    def on_validation_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self.add_features(batch)


READ_BY = {"target_devices": ("separate",), "prefetch": ("separate", "engine")} | {
    name: ("engine",) for name in ("engine_urls", "engine_command", "engine_streams", "engine_request_timeout_s",
                                   "engine_deadline_s", "engine_startup_s")}
"""The arguments only some placements read -> those placements."""


def check_target_settings(**arguments: Any) -> None:
    """Refuse a `TargetFeatures` argument (given by name, the others at their defaults) outside its range, or set where
    its placement does not read it, in one line naming the field; the CLI calls it on its `target` section before
    the model reads the target."""
    signature = inspect.signature(TargetFeatures.__init__)
    bound = signature.bind_partial(**arguments)
    bound.apply_defaults()
    a = bound.arguments
    placement, default = a["placement"], {name: p.default for name, p in signature.parameters.items()}
    for name in ("prefetch", "engine_streams"):
        if a[name] < 1:
            raise ConfigError(f"target.{name} must be >= 1, got {a[name]}")
    for name in ("engine_request_timeout_s", "engine_deadline_s", "engine_startup_s"):
        if not 0 < a[name] < math.inf:
            raise ConfigError(f"target.{name} must be a finite number of seconds > 0, got {a[name]}")
    for url in a["engine_urls"] or []:
        check_url(url)
    if placement == "separate" and not a["target_devices"]:
        raise ConfigError("target.target_devices: name the devices of the target for placement 'separate'")
    if placement == "engine" and not a["engine_urls"]:
        raise ConfigError("target.engine_urls: name the engines' URLs (http://host:port/v1) for placement 'engine'")
    unused = [name for name, by in READ_BY.items() if placement not in by and a[name] != default[name]
              and (a[name] or default[name] is not None)]  # an empty list is no list
    if unused:
        by = READ_BY[unused[0]]
        unused = [name for name in unused if READ_BY[name] == by]
        raise ConfigError(f"target.{', target.'.join(unused)}: used by placement {' or '.join(map(repr, by))} only, "
                          f"placement is {placement!r}, so ignored; add --target.placement={by[-1]}, or drop "
                          f"{'it' if len(unused) == 1 else 'them'}")
    if placement == "engine" and (a["fp8"] or a["compile"]):
        raise ConfigError("target.fp8/target.compile: the engine runs the target, set its precision in "
                          "`vllm serve` (--dtype, --quantization)")
    if a["fp8"] and a["dtype"] != "bfloat16":
        raise ConfigError(f"target.fp8: needs target.dtype bfloat16 (FP8 matmuls return bf16), not {a['dtype']}")
    if a["fp8"] and placement == "sharded":
        raise ConfigError("target.fp8: not with placement 'sharded' (FP8 weights are not sharded); use colocated, "
                          "or add --target.fp8=false")
    if a["compile"] and placement == "sharded":
        raise ConfigError("target.compile: not with placement 'sharded' (its layers gather their weights "
                          "through FSDP hooks); use colocated or separate, or drop target.compile")
    if a["feature_cache"] and a["fp8"]:  # the cache's features came from the target it was written with
        raise ConfigError(f"target.fp8: data.feature_cache {a['feature_cache']} serves stored features, no target "
                          "runs; add --target.fp8=false (FP8 target features are not cached)")
    if a["feature_cache"] and placement != "colocated":
        raise ConfigError(f"target.placement={placement}: data.feature_cache {a['feature_cache']} serves stored "
                          "features, no target runs; drop --target.placement (or the feature cache)")


def check_url(url: str) -> None:
    """Refuse an engine URL that is not an http(s) base URL with a host (`127.0.0.1:8000/v1` lacks the scheme)."""
    try:
        parts = urllib.parse.urlsplit(url)
        ok = parts.scheme in ("http", "https") and bool(parts.hostname) and (parts.port is None or parts.port > 0)
    except ValueError:  # a port that is not a number
        ok = False
    if not ok:
        raise ConfigError(f"target.engine_urls: {url!r} is not an http(s) URL with a host; give each engine's OpenAI "
                          "base URL, http://host:port/v1")


def warm_up(extractor: FeatureExtractor, token_budget: int | None) -> None:
    """One forward of a row of `token_budget` tokens on a CUDA target, so its kernels compile on this thread."""
    device = next(extractor.parameters()).device
    if device.type != "cuda" or not token_budget:
        return
    positions = torch.arange(token_budget, device=device)
    extractor(torch.zeros_like(positions), positions)
