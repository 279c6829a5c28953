"""The frozen target: its context features (DFLASH.md section 1) and the callback that serves them.

Only the target's first `max(layer_ids) + 1` decoder layers are built and run; no LM head is built. The
target never enters the LightningModule or its checkpoint.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor, nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model_dir(path: str) -> Path:
    """A local model folder as is, or a hub id resolved through the local Hugging Face cache."""
    local = Path(path).expanduser()
    if local.is_dir():
        return local
    if local.exists() or path.startswith((".", "/", "~")) or path.count("/") != 1:
        raise FileNotFoundError(f"target: no model folder at '{path}'")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(path, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]))


def load_target_config(path: str) -> Any:
    """The target's Hugging Face config (its text config for multimodal targets)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(resolve_model_dir(path))
    return getattr(config, "text_config", None) or config


def tokenizer_ids(path: str) -> tuple[int | None, list[int]]:
    """(number of token ids the tokenizer knows, ids of its reserved, never-emitted special tokens).

    (None, []) for a folder without a tokenizer: then the mask id must be given explicitly.
    """
    from transformers import AutoTokenizer

    folder = resolve_model_dir(path)
    if not any((folder / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None, []
    tokenizer = AutoTokenizer.from_pretrained(folder)
    reserved = sorted(i for i, t in tokenizer.added_tokens_decoder.items() if "reserved" in str(t.content))
    return len(tokenizer), reserved


def load_target_io(path: str) -> tuple[Tensor, Tensor]:
    """The target's input embedding and LM head weights `[V, H]`, read alone from its safetensors."""
    from safetensors import safe_open

    folder = resolve_model_dir(path)
    files = weight_map(folder)

    def find(suffix: str) -> str | None:
        hits = sorted(k for k in files if k.endswith(suffix) and "vision" not in k)
        return hits[0] if hits else None

    embed_key, head_key = find("embed_tokens.weight"), find("lm_head.weight")
    if embed_key is None:
        raise KeyError(f"target: no '*embed_tokens.weight' tensor in {folder}")
    head_key = head_key or embed_key  # tied embeddings

    def read(key: str) -> Tensor:
        with safe_open(folder / files[key], "pt") as f:
            return f.get_tensor(key)

    return read(embed_key), read(head_key)


class FeatureExtractor(nn.Module):
    """A truncated frozen target that returns the concatenated outputs of its `layer_ids`."""

    def __init__(self, model: nn.Module, layer_ids: list[int], num_target_layers: int) -> None:
        super().__init__()
        self.model, self.layer_ids = model, list(layer_ids)
        self._captured: dict[int, Tensor] = {}
        layers = _decoder_layers(model)
        # hidden_states[L] in HF numbering is normed: the last layer's feature is the final norm's output.
        last, norm = num_target_layers - 1, getattr(model, "norm", None)
        for j in sorted(set(self.layer_ids)):
            source = norm if j == last and norm is not None else layers[j]
            source.register_forward_hook(self._capture(j))
        self.requires_grad_(False).eval()

    @classmethod
    def from_pretrained(
        cls, path: str, layer_ids: list[int], dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu", attn_implementation: str = "sdpa", mesh: DeviceMesh | None = None,
    ) -> FeatureExtractor:
        """Load only the decoder layers the features need (no LM head).

        With `mesh`, the target is sharded across the mesh's ranks (FSDP2): each rank reads only its rows
        of every weight and holds 1/N of the target; a forward gathers one layer's weights at a time.
        """
        from transformers import AutoConfig, AutoModel
        from transformers.utils import logging as hf_logging

        folder = resolve_model_dir(path)
        config = AutoConfig.from_pretrained(folder)
        text = getattr(config, "text_config", None) or config
        total = text.num_hidden_layers
        keep = max(layer_ids) + 1
        truncated = copy.deepcopy(config)
        t_text = getattr(truncated, "text_config", None) or truncated
        t_text.num_hidden_layers = keep
        if isinstance(getattr(t_text, "layer_types", None), list):
            t_text.layer_types = t_text.layer_types[:keep]
        if mesh is not None:
            model = _sharded_model(folder, truncated, dtype, attn_implementation, mesh, torch.device(device))
            return cls(getattr(model, "language_model", model), layer_ids, total)
        level = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # the skipped layers and head are expected, not worth a warning
        try:
            model = AutoModel.from_pretrained(
                folder, config=truncated, dtype=dtype, attn_implementation=attn_implementation
            )
        finally:
            hf_logging.set_verbosity(level)
        model = getattr(model, "language_model", model)
        return cls(model, layer_ids, total).to(device)

    def _capture(self, j: int):
        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            self._captured[j] = output[0] if isinstance(output, tuple) else output

        return hook

    @torch.no_grad()
    def forward(self, input_ids: Tensor, position_ids: Tensor) -> Tensor:
        """Context features of a packed row `[T]`: per-document causal attention.  # [T, K*H]"""
        # Positions restarting at 0 mark document starts. For SDPA the per-document causal mask is built
        # here, on the device; left to transformers, finding the documents costs a host sync per forward.
        self._captured.clear()
        mask = None
        if getattr(self.model.config, "_attn_implementation", None) == "sdpa":
            mask = packed_causal_mask(position_ids)[None, None]  # [1, 1, T, T], True = attend
        self.model(input_ids=input_ids[None], position_ids=position_ids[None], attention_mask=mask, use_cache=False)
        if hasattr(self.model, "reshard"):  # a sharded target: free the gathered root weights too
            self.model.reshard()
        outs = [self._captured[j][0] for j in self.layer_ids]
        self._captured.clear()
        return torch.cat(outs, dim=-1)


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Modules built inside get meta parameters (no memory, no init) and real buffers (rotary tables)."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _sharded_model(folder: Path, config: Any, dtype: torch.dtype, attn_implementation: str, mesh: DeviceMesh,
                   device: torch.device) -> nn.Module:
    """The truncated target with every decoder layer and the rest sharded over `mesh`, weights read by rows."""
    from safetensors import safe_open
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModel

    with _parameters_on_meta():
        model = AutoModel.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    text = getattr(model, "language_model", model)
    for layer in _decoder_layers(text):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    model.to_empty(device=device)
    with torch.no_grad():
        for name, value in buffers.items():
            model.get_buffer(name).copy_(value)
        files = weight_map(folder)
        rank, world = mesh.get_local_rank(), mesh.size()
        for name, param in model.named_parameters():
            key = _checkpoint_key(name, files, folder)
            local = param.to_local()
            rows = param.shape[0]
            chunk = -(-rows // world)  # FSDP2 shards dim 0 as torch.chunk does
            start, stop = min(rows, rank * chunk), min(rows, (rank + 1) * chunk)
            if local.shape[0] != stop - start:
                raise RuntimeError(f"sharded target: unexpected shard of '{name}': {tuple(local.shape)}")
            with safe_open(folder / files[key], "pt") as f:
                tensor = f.get_slice(key)
                if tuple(tensor.get_shape()) != tuple(param.shape):
                    raise ValueError(f"target: {folder}: tensor '{key}' has shape {tuple(tensor.get_shape())}, "
                                     f"the model expects {tuple(param.shape)}")
                local.copy_(tensor[start:stop].to(dtype))
    return model.eval()


def weight_map(folder: Path) -> dict[str, str]:
    """Tensor name -> safetensors file name of a Hugging Face folder (sharded with an index, or one file)."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.exists():
        return json.loads(index.read_text())["weight_map"]
    single = folder / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"{folder}: no model.safetensors or model.safetensors.index.json")
    with safe_open(single, "pt") as f:
        return {k: single.name for k in f.keys()}  # noqa: SIM118


def _checkpoint_key(name: str, files: dict[str, str], folder: Path) -> str:
    """The checkpoint tensor of a base-model parameter (`layers.0.mlp...` is `model.layers.0.mlp...`)."""
    hits = [k for k in files if k == name or k.endswith("." + name)]
    if len(hits) != 1:
        found = f"{len(hits)} tensors ({', '.join(hits[:3])})" if hits else "no tensor"
        raise KeyError(f"target: {folder} has {found} for parameter '{name}'; a sharded target reads weights by "
                       "name and cannot follow checkpoints whose weights transformers converts on load")
    return hits[0]


def packed_causal_mask(position_ids: Tensor) -> Tensor:
    """Causal attention within each document of a packed row whose positions restart at 0.  # [T, T] bool"""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[1:] = position_ids[1:] != position_ids[:-1] + 1
    doc = starts.cumsum(0)
    index = torch.arange(position_ids.numel(), device=position_ids.device)
    return (doc[:, None] == doc[None, :]) & (index[:, None] >= index[None, :])


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    for name in ("layers", "h", "blocks"):
        layers = getattr(model, name, None)
        if isinstance(layers, nn.ModuleList):
            return layers
    raise TypeError(f"cannot find the decoder layers of {type(model).__name__}")


class FeaturePrefetcher:
    """Wraps a dataloader: target threads on their own devices compute features ahead of the trainer.

    Batch i+1.. are computed while the drafter trains on batch i, at most `depth` batches ahead per
    device; batches come out in loader order. Only the eager target runs in the threads; every
    compiled drafter call stays on the trainer's thread.
    """

    def __init__(self, loader: Any, extractors: list[FeatureExtractor], out_device: torch.device, depth: int) -> None:
        self.loader, self.extractors, self.out_device, self.depth = loader, extractors, out_device, depth

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:  # sampler, dataset, state_dict ... of the wrapped loader
        return getattr(self.loader, name)

    def __iter__(self):
        import queue
        import threading

        n = len(self.extractors)
        source, lock, stop = iter(self.loader), threading.Lock(), threading.Event()
        outs = [queue.Queue(maxsize=self.depth) for _ in range(n)]
        turn = [0]  # next batch index to take from the source; threads take batches in strict rotation
        cond = threading.Condition(lock)

        def work(rank: int) -> None:
            extractor = self.extractors[rank]
            device = next(extractor.parameters()).device
            while not stop.is_set():
                with cond:
                    cond.wait_for(lambda: turn[0] % n == rank or stop.is_set())
                    if stop.is_set():
                        return
                    try:
                        batch = next(source)
                    except StopIteration:
                        batch = None
                    except BaseException as err:  # hand loader errors to the trainer's thread
                        batch = err
                    turn[0] += 1
                    cond.notify_all()
                if batch is None or isinstance(batch, BaseException):
                    outs[rank].put(batch)
                    return
                try:
                    feats = extractor(batch["input_ids"].to(device), batch["position_ids"].to(device))
                    batch["context_features"] = feats.to(self.out_device)
                except BaseException as err:
                    batch = err
                outs[rank].put(batch)

        threads = [threading.Thread(target=work, args=(r,), daemon=True) for r in range(n)]
        for t in threads:
            t.start()
        try:
            i = 0
            while True:
                item = outs[i % n].get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
                i += 1
        finally:
            stop.set()
            with cond:
                cond.notify_all()
            for q in outs:  # unblock producers waiting on a full queue
                while not q.empty():
                    q.get_nowait()


def rank_devices(devices: list[str], local_rank: int, ranks_per_node: int) -> list[str]:
    """The target devices one of a node's trainer ranks drives: every N-th from its local rank.

    6 target GPUs and 2 trainer ranks: 3 each. With fewer devices than ranks, ranks share one device
    (2 target GPUs, 4 ranks: two copies on each). Loads must balance, or the other ranks wait.
    """
    n, k = ranks_per_node, len(devices)
    if k % n and n % k:
        raise ValueError(
            f"target.target_devices: {k} devices cannot be shared evenly by {n} trainer ranks per node; "
            f"use a multiple or a divisor of {n}"
        )
    return devices[local_rank::n] if k >= n else [devices[local_rank % k]]


def node_mesh(trainer: Trainer) -> DeviceMesh:
    """The 1-D device mesh of this node's trainer ranks (a sharded target stays inside a node's links)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("target.placement 'sharded' needs a distributed strategy over several devices "
                         "(--trainer.strategy=ddp or fsdp); on one device use 'colocated'")
    shape = (trainer.num_nodes, trainer.num_devices)
    if shape[0] * shape[1] != dist.get_world_size():
        raise ValueError(f"target.placement 'sharded': {shape[0]} nodes x {shape[1]} devices != world size "
                         f"{dist.get_world_size()}")
    mesh = init_device_mesh(trainer.strategy.root_device.type, shape, mesh_dim_names=("node", "local"))
    return mesh["local"]


class TargetFeatures(Callback):
    """Owns the frozen target and puts each batch's context features into it before the step."""

    def __init__(
        self,
        path: str,
        dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16",
        placement: Literal["colocated", "separate", "sharded"] = "colocated",
        target_devices: list[str] | None = None,
        prefetch: int = 2,
        attn_implementation: str = "sdpa",
    ) -> None:
        """
        Args:
            path: Hugging Face model folder or hub id of the target.
            dtype: Dtype the target runs in.
            placement: `colocated`: the target runs on the trainer's own device, features never leave it;
                `separate`: copies of the target on `target_devices` compute features ahead in threads;
                `sharded`: one target sharded over the node's trainer GPUs (for a target too large for one),
                each rank running its own batch through it.
            target_devices: Devices of the target copies for `separate` (e.g. [cuda:2, cuda:3]); with several
                trainer devices per node they are dealt out among the node's ranks (see `rank_devices`).
            prefetch: Batches each separate target may compute ahead of the trainer (a bounded queue).
            attn_implementation: transformers attention backend of the target (sdpa, eager, flex_attention).
        """
        if placement == "separate" and not target_devices:
            raise ValueError("target.target_devices: name the devices of the target for placement 'separate'")
        if prefetch < 1:
            raise ValueError(f"target.prefetch must be >= 1, got {prefetch}")
        self.path, self.dtype, self.placement, self.attn_implementation = path, dtype, placement, attn_implementation
        self.target_devices, self.prefetch = list(target_devices or []), prefetch
        self.extractor: FeatureExtractor | None = None
        self.extractors: list[FeatureExtractor] = []

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.extractor is not None or self.extractors:
            return
        if getattr(trainer.datamodule, "hparams", {}).get("feature_cache"):
            return  # the data module serves cached context features; no target is needed
        layer_ids = pl_module.drafter_config.target_layer_ids

        if self.placement == "colocated":
            self.extractor = self.load_extractor(trainer.strategy.root_device, layer_ids)
            return
        if self.placement == "sharded":
            self.extractor = self.load_extractor(trainer.strategy.root_device, layer_ids, node_mesh(trainer))
            return
        devices = rank_devices(self.target_devices, trainer.local_rank, trainer.num_devices)
        self.extractors = [self.load_extractor(d, layer_ids) for d in devices]
        datamodule, device = trainer.datamodule, trainer.strategy.root_device
        for name in ("train_dataloader", "val_dataloader"):
            if not is_overridden(name, datamodule):  # a data module without validation keeps it that way
                continue
            make = getattr(datamodule, name)
            setattr(datamodule, name, lambda make=make: self.prefetched(make(), device))

    def load_extractor(
        self, device: torch.device | str, layer_ids: list[int], mesh: DeviceMesh | None = None
    ) -> FeatureExtractor:
        """The target's feature extractor on `device` (sharded over `mesh` when given)."""
        return FeatureExtractor.from_pretrained(
            self.path, layer_ids, DTYPES[self.dtype], device, self.attn_implementation, mesh
        )

    def prefetched(self, loader: Any, device: torch.device) -> Any:
        """`loader` with features computed ahead by the separate targets (empty loaders pass through)."""
        if isinstance(loader, (list, tuple)) and not loader:
            return loader
        return FeaturePrefetcher(loader, self.extractors, device, self.prefetch)

    def add_features(self, batch: dict[str, Tensor]) -> None:
        """Write `context_features [T, K*H]` into the batch unless a separate target already did."""
        if "context_features" in batch:
            return
        if self.extractor is None:
            raise RuntimeError("TargetFeatures: a batch arrived without features and no target is on this device")
        batch["context_features"] = self.extractor(batch["input_ids"], batch["position_ids"])

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self.add_features(batch)

    def on_validation_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self.add_features(batch)
