"""The sharded placement: one target split over a node's trainer GPUs (FSDP2), each rank reading its rows.

For a target too large for one GPU; the node mesh keeps the weight gathers on the node's own links.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dflash_lightning.target_model.loading import decoder_layers, weight_map

if TYPE_CHECKING:
    from lightning.pytorch import Trainer
    from torch.distributed.device_mesh import DeviceMesh


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


def sharded_model(folder: Path, config: Any, dtype: torch.dtype, attn_implementation: str, mesh: DeviceMesh,
                   device: torch.device) -> nn.Module:
    """The truncated target with every decoder layer and the rest sharded over `mesh`, weights read by rows."""
    from safetensors import safe_open
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModel

    with _parameters_on_meta():
        model = AutoModel.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    text = getattr(model, "language_model", model)
    for layer in decoder_layers(text):
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


def _checkpoint_key(name: str, files: dict[str, str], folder: Path) -> str:
    """The checkpoint tensor of a base-model parameter (`layers.0.mlp...` is `model.layers.0.mlp...`)."""
    hits = [k for k in files if k == name or k.endswith("." + name)]
    if len(hits) != 1:
        found = f"{len(hits)} tensors ({', '.join(hits[:3])})" if hits else "no tensor"
        raise KeyError(f"target: {folder} has {found} for parameter '{name}'; a sharded target reads weights by "
                       "name and cannot follow checkpoints whose weights transformers converts on load")
    return hits[0]


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
