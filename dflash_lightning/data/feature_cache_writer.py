"""The feature cache's writer: the frozen target under Lightning's predict loop, one shard file at a time.

`python -m dflash_lightning cache --config configs/tiny.yaml --out cache/tiny --format bf16|fp8` runs it on any
number of devices (each rank writes its own shards) and resumes; the format is in `feature_cache.py`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from dflash_lightning.data.feature_cache import (
    COMPARED,
    MANIFEST,
    STORED,
    VERSION,
    WRITER_COMPARED,
    FeatureCacheError,
    FeatureFormat,
    compare_headers,
    data_header,
    quantize_fp8,
    sample_checksums,
    target_header,
)
from dflash_lightning.long_runs.atomic import write_atomic, write_json
from dflash_lightning.target_model import DTYPES, FeatureExtractor
from dflash_lightning.target_model.fingerprints import sha256_path

if TYPE_CHECKING:
    from dflash_lightning.data.conversations import TokenizedSamples
    from dflash_lightning.data.datamodule import DFlashDataModule

log = logging.getLogger(__name__)


def plan_shards(split: str, lengths: Sequence[int], bytes_per_token: int, shard_bytes: int) -> list[dict[str, Any]]:
    """Consecutive sample ranges of about `shard_bytes` each (at least one sample), named `{split}-{i}`."""
    shards, first, size = [], 0, 0
    for i, n in enumerate(lengths):
        if size and size + n * bytes_per_token > shard_bytes:
            shards.append((first, i))
            first, size = i, 0
        size += n * bytes_per_token
    if first < len(lengths):
        shards.append((first, len(lengths)))
    return [{"file": f"{split}-{k:05d}.safetensors", "first": a, "end": b, "bytes": None, "sha256": None}
            for k, (a, b) in enumerate(shards)]


def write_shard(path: Path, tensors: dict[str, Tensor], metadata: dict[str, str]) -> dict[str, Any]:
    """Writes one shard atomically; returns its size and sha256 for the manifest."""
    from safetensors.torch import save_file

    write_atomic(path, lambda tmp: save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata))
    return {"bytes": path.stat().st_size, "sha256": sha256_path(path)}


class _ForwardRows(Dataset):
    """This rank's shards as target forward rows: consecutive samples up to `forward_tokens` per row, padded to one
    length (a document of token 0 after the real ones, which attend only within themselves): on CUDA the target's
    flex attention is compiled for fixed shapes (`dynamic=False`), so rows of many lengths recompile it, and past
    torch's recompile limit it runs unfused. `tokens` is the real length; the padding's features are dropped."""

    def __init__(self, shards: list[dict[str, Any]], samples: dict[str, TokenizedSamples], forward_tokens: int):
        self.rows, self.length = [], forward_tokens
        for shard in shards:
            split = shard["file"].split("-")[0]
            lengths = samples[split].lengths()
            groups, size = [[]], 0
            for i in range(shard["first"], shard["end"]):
                if groups[-1] and size + lengths[i] > forward_tokens:
                    groups.append([])
                    size = 0
                groups[-1].append(i)
                size += lengths[i]
            self.rows += [(split, shard, g, k == len(groups) - 1) for k, g in enumerate(groups)]
            longest = max((sum(int(lengths[i]) for i in g) for g in groups), default=0)
            self.length = max(self.length, longest)  # one sample longer than forward_tokens is a row alone
        self.samples = samples

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, k: int) -> dict[str, Any]:
        split, shard, docs, last = self.rows[k]
        ids = [self.samples[split].document(i)[0] for i in docs]
        tokens = sum(len(x) for x in ids)
        pad = torch.zeros(self.length - tokens, dtype=torch.long)
        return {"input_ids": torch.cat([*ids, pad]).long(),
                "position_ids": torch.cat([*(torch.arange(len(x)) for x in ids), torch.arange(len(pad))]),  # restarts
                "tokens": tokens, "split": split, "shard": shard["file"], "last": last}  # mark documents


class FeatureModule(LightningModule):
    """The frozen target in the predict loop: a forward row in, its context features out (bf16 or fp8)."""

    allow_zero_length_dataloader_with_multiple_devices = True  # a rank may have no shard left to write

    def __init__(self, path: str, layer_ids: list[int], dtype: str, attn_implementation: str,
                 feature_format: FeatureFormat, final_hidden: bool = False, compile_target: bool = False) -> None:
        super().__init__()
        self.path, self.layer_ids, self.dtype_name = path, list(layer_ids), dtype
        self.attn_implementation, self.feature_format = attn_implementation, feature_format
        self.final_hidden, self.compile_target = final_hidden, compile_target
        self.extractor: FeatureExtractor | None = None

    def configure_model(self) -> None:
        if self.extractor is not None:
            return
        device = self.trainer.strategy.root_device
        if self.compile_target:
            FeatureExtractor.check_compile_device(device)
        self.extractor = FeatureExtractor.from_pretrained(
            self.path, self.layer_ids, DTYPES[self.dtype_name], device, self.attn_implementation,
            final_hidden=self.final_hidden,
        )
        if self.compile_target:
            self.extractor.compile_layers()

    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, Tensor]:
        fields = self.extractor.extract(batch["input_ids"], batch["position_ids"])
        n = int(batch["tokens"])  # the real tokens; the rest is the row's padding
        features = fields["context_features"][:n]  # [row tokens, K*H]
        # The teacher stays bf16 in either format: fp8 would blur the distribution that distillation learns.
        out = {"final_hidden": fields["final_hidden"][:n].to(torch.bfloat16).cpu()} if self.final_hidden else {}
        if self.feature_format == "fp8":
            values, scales = quantize_fp8(features)  # on the device: it moves half the bytes to the host
            return {"features": values.cpu(), "scales": scales.cpu(), **out}
        return {"features": features.to(torch.bfloat16).cpu(), **out}


class _CacheWork(LightningDataModule):
    """Decides on rank 0 which shards are missing (after checking the folder), and gives each rank its share."""

    def __init__(self, folder: Path, manifest: dict[str, Any], samples: dict[str, TokenizedSamples],
                 forward_tokens: int) -> None:
        super().__init__()
        self.folder, self.manifest, self.samples, self.forward_tokens = folder, manifest, samples, forward_tokens
        self.mine: list[dict[str, Any]] = []

    def setup(self, stage: str) -> None:
        strategy = self.trainer.strategy
        decision: dict[str, Any] = {}
        if self.trainer.global_rank == 0:
            try:
                decision = {"done": prepare_folder(self.folder, self.manifest)}
            except FeatureCacheError as err:
                decision = {"error": str(err)}
        decision = strategy.broadcast(decision, src=0)  # every rank raises, rather than waiting for rank 0
        if "error" in decision:
            raise FeatureCacheError(decision["error"])
        todo = [s for sp in self.manifest["splits"].values() for s in sp["shards"] if s["file"] not in decision["done"]]
        self.mine = todo[self.trainer.global_rank :: self.trainer.world_size]
        rank_zero_info(f"feature cache {self.folder}: {len(todo)} of "
                       f"{sum(len(sp['shards']) for sp in self.manifest['splits'].values())} shards to write")

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(_ForwardRows(self.mine, self.samples, self.forward_tokens), batch_size=None)


class ShardWriter(Callback):
    """Collects a shard's forward rows, writes the shard atomically, and records it in this rank's progress file."""

    def __init__(self, folder: Path, manifest: dict[str, Any], samples: dict[str, TokenizedSamples]) -> None:
        self.folder, self.manifest, self.samples = folder, manifest, samples
        self.parts: list[dict[str, Tensor]] = []
        self.written: dict[str, dict[str, Any]] = {}

    def on_predict_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                             batch_idx: int, dataloader_idx: int = 0) -> None:
        self.parts.append(outputs)
        if not batch["last"]:
            return
        split = self.manifest["splits"][batch["split"]]
        shard = next(s for s in split["shards"] if s["file"] == batch["shard"])
        samples = self.samples[batch["split"]]
        a, b = int(samples.starts[shard["first"]]), int(samples.starts[shard["end"]])
        tensors = {name: torch.cat([p[name] for p in self.parts]) for name in self.parts[0]}
        assert tensors["features"].shape[0] == b - a, "forward rows do not add up to the shard's tokens"
        tensors |= {"input_ids": samples.input_ids[a:b].to(torch.int32), "loss_mask": samples.loss_mask[a:b],
                    "starts": samples.starts[shard["first"] : shard["end"] + 1] - a}
        tensors["crc32"] = sample_checksums(tensors)
        # one metadata key: safetensors writes several in random order, and equal shards should be equal files
        info = {"split": batch["split"], "first": shard["first"], "end": shard["end"],
                "format": self.manifest["feature_format"]}
        metadata = {"dflash_feature_cache": json.dumps(info)}
        self.written[shard["file"]] = write_shard(self.folder / shard["file"], tensors, metadata)
        write_json(self.folder / f"progress-rank{trainer.global_rank}.json", self.written)
        self.parts = []

    def on_predict_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        trainer.strategy.barrier()  # every rank's shards are on disk
        if trainer.global_rank == 0:
            finalize_folder(self.folder, self.manifest)
        trainer.strategy.barrier()


def _completed(folder: Path, manifest: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Shards the folder holds whole: recorded in the manifest or a progress file, with the recorded size."""
    records = {s["file"]: {"bytes": s["bytes"], "sha256": s["sha256"]}
               for sp in manifest["splits"].values() for s in sp["shards"] if s["sha256"] is not None}
    for progress in sorted(folder.glob("progress-rank*.json")):
        records |= json.loads(progress.read_text())
    done = {}
    for name, record in records.items():
        path = folder / name
        if path.exists() and path.stat().st_size == record["bytes"]:
            done[name] = record
        else:
            log.warning(f"feature cache shard {path} is missing or has the wrong size; it is written again")
    return done


def _with_completed(manifest: dict[str, Any], done: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out = json.loads(json.dumps(manifest))
    for split in out["splits"].values():
        for shard in split["shards"]:
            shard.update(done.get(shard["file"], {"bytes": None, "sha256": None}))
    out["complete"] = all(s["sha256"] is not None for sp in out["splits"].values() for s in sp["shards"])
    return out


def prepare_folder(folder: Path, manifest: dict[str, Any]) -> list[str]:
    """Checks an existing cache against this run (refusing a mismatch), records its finished shards; their names."""
    folder.mkdir(parents=True, exist_ok=True)
    done: dict[str, dict[str, Any]] = {}
    path = folder / MANIFEST
    if path.exists():
        found = json.loads(path.read_text())
        compare_headers(folder, found, manifest, COMPARED + WRITER_COMPARED)
        done = _completed(folder, found)
    write_json(path, _with_completed(manifest, done))
    return sorted(done)


def finalize_folder(folder: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Merges the ranks' progress files into the manifest and removes them; the final manifest."""
    current = json.loads((folder / MANIFEST).read_text())
    final = _with_completed(manifest, _completed(folder, current))
    write_json(folder / MANIFEST, final)
    for progress in folder.glob("progress-rank*.json"):
        progress.unlink()
    for tmp in folder.glob(".*.tmp"):  # shards whose writing an interruption cut short
        tmp.unlink()
    return final


def cache_manifest(dm: DFlashDataModule, target: str, target_dtype: str, layer_ids: Sequence[int],
                   hidden_size: int, feature_format: FeatureFormat, shard_bytes: int,
                   forward_tokens: int, final_hidden: bool = False,
                   ) -> tuple[dict[str, Any], dict[str, TokenizedSamples]]:
    """The manifest of a cache of `dm`'s samples (train, and val if it has val files) with the shard plan."""
    splits = {"train": (dm.train_paths, dm.samples("train"))}
    if dm.val_paths:
        splits["val"] = (dm.val_paths, dm.samples("val"))
    feature_dim = len(layer_ids) * hidden_size
    per_token = feature_dim * STORED[feature_format].itemsize + 4 + 1 + (4 if feature_format == "fp8" else 0)
    per_token += 2 * hidden_size if final_hidden else 0
    header = {"version": VERSION, "feature_format": feature_format, "feature_dim": feature_dim,
              "final_hidden": bool(final_hidden),
              **target_header(target, layer_ids, hidden_size), **data_header(dm, splits),
              "writing": {"shard_bytes": shard_bytes, "forward_tokens": forward_tokens}}
    header["target"]["dtype"] = target_dtype
    for split, (_, samples) in splits.items():
        header["splits"][split]["shards"] = plan_shards(split, samples.lengths(), per_token, shard_bytes)
    return header, {split: samples for split, (_, samples) in splits.items()}


def write_cache(
    dm: DFlashDataModule, target: str, layer_ids: Sequence[int], hidden_size: int, out: str | Path,
    feature_format: FeatureFormat = "bf16", target_dtype: str = "bfloat16", attn_implementation: str = "auto",
    shard_bytes: int = 1_000_000_000, forward_tokens: int | None = None, trainer_kwargs: dict[str, Any] | None = None,
    final_hidden: bool = False, compile_target: bool = False,
) -> dict[str, Any]:
    """Runs the target over `dm`'s samples with `Trainer.predict` and writes (or finishes) the cache; the manifest.

    `final_hidden` also stores the target's final normed hidden states, the teacher of distillation;
    `compile_target` compiles the target's layers (CUDA), as `target.compile` does in fit.
    """
    from lightning.pytorch.callbacks import RichProgressBar

    folder = Path(out)
    forward_tokens = forward_tokens or dm.token_budget
    manifest, samples = cache_manifest(dm, target, target_dtype, layer_ids, hidden_size, feature_format,
                                       shard_bytes, forward_tokens, final_hidden)
    module = FeatureModule(target, list(layer_ids), target_dtype, attn_implementation, feature_format, final_hidden,
                           compile_target)
    writer = ShardWriter(folder, manifest, samples)
    trainer = Trainer(**{"accelerator": "auto", "devices": "auto", **(trainer_kwargs or {})}, logger=False,
                      enable_checkpointing=False, enable_model_summary=False, use_distributed_sampler=False,
                      callbacks=[writer, RichProgressBar()])
    started = time.perf_counter()
    trainer.predict(module, datamodule=_CacheWork(folder, manifest, samples, forward_tokens),
                    return_predictions=False)
    final = json.loads((folder / MANIFEST).read_text())
    size = sum(s["bytes"] or 0 for sp in final["splits"].values() for s in sp["shards"])
    rank_zero_info(f"feature cache {folder}: {'complete' if final['complete'] else 'INCOMPLETE'}, "
                   f"{size / 1e9:.2f} GB, {time.perf_counter() - started:.0f} s this run")
    return final
