"""The feature cache: the target's context features (DFLASH.md section 1) computed once, stored per sample in
sharded safetensors with a manifest of everything they depend on, and read back by `DFlashDataModule`.

`python -m dflash_lightning cache --config configs/tiny.yaml --out cache/tiny --format bf16|fp8` runs the
target under Lightning's predict loop (any number of devices; each rank writes its own shards) and resumes.

Layout of `out/`:
    manifest.json             settings and fingerprints (see `cache_header`), shard plan, completed shards
    {split}-{i:05d}.safetensors   samples [first, end) of a split, laid end to end:
        features   [tokens, K*H] bf16, or float8_e4m3fn with `scales` [tokens] fp32 (row absmax / 448)
        input_ids  [tokens] int32;  loss_mask [tokens] bool;  starts [samples + 1] int64 (offsets in the shard)
    progress-rank{r}.json     shards a rank finished while the run is in progress (merged at the end)
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import time
import warnings
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from dflash_lightning.target import DTYPES, FeatureExtractor, resolve_model_dir

if TYPE_CHECKING:
    from dflash_lightning.data.conversations import TokenizedSamples
    from dflash_lightning.data.datamodule import DFlashDataModule

log = logging.getLogger(__name__)

VERSION = 1
MANIFEST = "manifest.json"
FeatureFormat = Literal["bf16", "fp8"]
FP8_MAX = 448.0  # largest finite float8_e4m3fn
STORED = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn, "F32": torch.float32,
                      "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool}
MAX_OPEN_SHARDS = 64  # per process: each mapped shard holds a file descriptor, and a cache can have thousands
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")


class FeatureCacheError(ValueError):
    """A feature cache that does not match the run, or a damaged one; the message names the field or shard."""


# -------------------------------------------------------------------------------------- fingerprints


def sha256_path(path: Path) -> str:
    """Content hash of a file, or of a folder's files (relative names and bytes, in name order)."""
    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        if path.is_dir():
            digest.update(str(file.relative_to(path)).encode() + b"\0")
        with file.open("rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


def target_fingerprint(path: str) -> dict[str, str]:
    """Hashes of the target's config and of its weights' headers and first MiB of data (cheap, catches fine-tunes)."""
    folder = resolve_model_dir(path)
    config = json.loads((folder / "config.json").read_text())
    weights = hashlib.sha256()
    for file in sorted(folder.glob("*.safetensors")):
        with file.open("rb") as f:
            n = int.from_bytes(f.read(8), "little")
            weights.update(f.read(n) + f.read(1 << 20))
    return {"config_sha256": hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest(),
            "weights_sha256": weights.hexdigest()}


def tokenizer_sha256(path: str) -> str:
    """Hash of the tokenizer's files (vocabulary, merges, special tokens, chat template)."""
    folder = resolve_model_dir(path)
    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        if (folder / name).exists():
            digest.update(name.encode() + b"\0" + (folder / name).read_bytes())
    return digest.hexdigest()


def samples_sha256(samples: TokenizedSamples) -> str:
    """Hash of the tokenized samples exactly as they are packed (ids, loss mask, document boundaries)."""
    digest = hashlib.sha256()
    for t in (samples.input_ids.to(torch.int32), samples.loss_mask.to(torch.uint8), samples.starts.to(torch.int64)):
        digest.update(t.contiguous().numpy().tobytes())
    return digest.hexdigest()


def data_header(dm: DFlashDataModule, splits: dict[str, tuple[list[Path], TokenizedSamples]]) -> dict[str, Any]:
    """The manifest fields that the data module decides: tokenizer, chat-template settings, files, samples."""
    hp = dm.hparams
    return {
        "tokenizer": {"path": str(hp.tokenizer), "sha256": tokenizer_sha256(hp.tokenizer)},
        "data": {"format": hp.format, "enable_thinking": hp.enable_thinking, "max_length": dm.max_length,
                 "block_size": hp.block_size, "min_supervised_tokens": dm.min_supervised,
                 "on_bad_record": hp.on_bad_record},
        "splits": {
            split: {"files": [str(p) for p in paths], "files_sha256": [sha256_path(p) for p in paths],
                    "num_samples": len(samples), "num_tokens": int(samples.input_ids.numel()),
                    "samples_sha256": samples_sha256(samples)}
            for split, (paths, samples) in splits.items()
        },
    }


def target_header(path: str, layer_ids: Sequence[int], hidden_size: int) -> dict[str, Any]:
    """The manifest fields that the target and the drafter's layer choice decide."""
    return {"target": {"path": str(path), **target_fingerprint(path), "layer_ids": list(layer_ids),
                       "hidden_size": int(hidden_size)}}


# Fields a reader compares (dotted paths; `*` is every split of the run). Paths and sizes are informational.
COMPARED = (
    "version", "target.config_sha256", "target.weights_sha256", "target.layer_ids", "target.hidden_size",
    "tokenizer.sha256", "data.format", "data.enable_thinking", "data.max_length", "data.block_size",
    "data.min_supervised_tokens", "data.on_bad_record", "splits.*.files_sha256", "splits.*.num_samples",
    "splits.*.samples_sha256",
)
# ... and a resumed cache run also these, which decide the shards already written.
WRITER_COMPARED = ("feature_format", "target.dtype", "writing.shard_bytes", "writing.forward_tokens")


def _get(tree: dict[str, Any], dotted: str) -> Any:
    for key in dotted.split("."):
        if not isinstance(tree, dict) or key not in tree:
            return KeyError
        tree = tree[key]
    return tree


def compare_headers(cache: Path, found: dict[str, Any], expected: dict[str, Any], fields: Sequence[str]) -> None:
    """Raise naming the first field of `fields` present in `expected` whose value the cache does not share."""
    for pattern in fields:
        names = [pattern]
        if "*" in pattern:
            names = [pattern.replace("*", s) for s in expected.get("splits", {})]
        for name in names:
            want = _get(expected, name)
            if want is KeyError:
                continue  # not known to this reader (e.g. the target, when reading without a model)
            have = _get(found, name)
            if have != want:
                hint = ""
                if name.endswith("files_sha256"):
                    split = name.split(".")[1]
                    hint = (f"; the cache was made from {_get(found, f'splits.{split}.files')}, this run reads "
                            f"{_get(expected, f'splits.{split}.files')}")
                if have is KeyError:
                    have = "missing"
                raise FeatureCacheError(
                    f"feature cache {cache} does not match this run: {name} is {have!r} in the cache and {want!r} "
                    f"here{hint}. Make a new cache for these settings (python -m dflash_lightning cache)"
                )


# ------------------------------------------------------------------------------------------------ fp8


def quantize_fp8(x: Tensor) -> tuple[Tensor, Tensor]:
    """Rowwise float8_e4m3fn with a float32 scale per row (absmax / 448); all-zero rows get scale 1."""
    x = x.float()
    scales = x.abs().amax(dim=-1) / FP8_MAX  # [rows]
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    return (x / scales[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scales


def dequantize(values: Tensor, scales: Tensor) -> Tensor:
    """float32 features from rowwise fp8 values `[rows, D]` and their scales `[rows]`."""
    return values.float() * scales[:, None]


# ------------------------------------------------------------------------------------------- shards


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


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, write: Any) -> None:
    """`write(tmp_path)`, fsync, then rename over `path`: a reader sees the old file or the whole new one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    write(tmp)
    with tmp.open("rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def write_json(path: Path, obj: Any) -> None:
    """A JSON file written atomically."""
    write_atomic(path, lambda tmp: tmp.write_text(json.dumps(obj, indent=1)))


def write_shard(path: Path, tensors: dict[str, Tensor], metadata: dict[str, str]) -> dict[str, Any]:
    """Writes one shard atomically; returns its size and sha256 for the manifest."""
    from safetensors.torch import save_file

    write_atomic(path, lambda tmp: save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata))
    return {"bytes": path.stat().st_size, "sha256": sha256_path(path)}


class Shard:
    """A memory-mapped shard: its tensors are views of the file (no read until they are sliced and copied)."""

    def __init__(self, path: Path, expected_bytes: int) -> None:
        if not path.exists():
            raise FeatureCacheError(f"feature cache shard {path} is missing")
        size = path.stat().st_size
        if size != expected_bytes:
            raise FeatureCacheError(f"feature cache shard {path} has {size} bytes, the manifest records "
                                    f"{expected_bytes}: it is truncated or was rewritten")
        with path.open("rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            n = int.from_bytes(self._map[:8], "little")
            header = json.loads(self._map[8 : 8 + n])
            header.pop("__metadata__", None)
            with warnings.catch_warnings():  # read-only map: the views are only ever read
                warnings.simplefilter("ignore", UserWarning)
                data = torch.frombuffer(self._map, dtype=torch.uint8)
            self.tensors: dict[str, Tensor] = {}
            for name, info in header.items():
                begin, end = (8 + n + o for o in info["data_offsets"])
                if end > size:
                    raise ValueError(f"tensor '{name}' ends at byte {end}, past the file's end")
                raw = data[begin:end]
                dtype = SAFETENSORS_DTYPES[info["dtype"]]
                if begin % dtype.itemsize:  # safetensors aligns by sorting; copy if a writer did not
                    raw = raw.clone()
                self.tensors[name] = raw.view(dtype).view(info["shape"])
        except (ValueError, KeyError, TypeError, RuntimeError) as err:
            raise FeatureCacheError(f"feature cache shard {path} is corrupt: unreadable safetensors header "
                                    f"({type(err).__name__}: {err})") from err


class SplitFeatures:
    """The context features of one split's samples, gathered into packed rows."""

    def __init__(self, folder: Path, shards: list[dict[str, Any]], feature_format: FeatureFormat,
                 feature_dim: int) -> None:
        self.folder, self.shards = folder, shards
        self.feature_format, self.feature_dim = feature_format, feature_dim
        self.firsts = [s["first"] for s in shards]
        self._open: OrderedDict[int, Shard] = OrderedDict()  # least recently used first

    def __getstate__(self) -> dict[str, Any]:  # DataLoader workers map the shards themselves
        return {**self.__dict__, "_open": OrderedDict()}

    def shard(self, k: int) -> Shard:
        """Shard k, mapped on first use (size and header checked then); at most MAX_OPEN_SHARDS stay mapped."""
        if k in self._open:
            self._open.move_to_end(k)
        else:
            if len(self._open) >= MAX_OPEN_SHARDS:
                self._open.popitem(last=False)
            self._open[k] = Shard(self.folder / self.shards[k]["file"], self.shards[k]["bytes"])
        return self._open[k]

    def document(self, i: int) -> dict[str, Tensor]:
        """Views of sample i's stored tensors: features [n, K*H] (+ scales [n]), input_ids, loss_mask."""
        k = bisect_right(self.firsts, i) - 1
        shard = self.shard(k).tensors
        starts = shard["starts"]
        a, b = int(starts[i - self.firsts[k]]), int(starts[i - self.firsts[k] + 1])
        names = ("features", "scales", "input_ids", "loss_mask") if self.feature_format == "fp8" else (
            "features", "input_ids", "loss_mask")
        return {name: shard[name][a:b] for name in names}

    def packed(self, row: Sequence[int], token_budget: int) -> dict[str, Tensor]:
        """Features of the documents of a packed row, laid out as `collate_documents` lays out their tokens.

        bf16: `context_features` [T, K*H]; fp8: `context_features_fp8` [T, K*H] and `context_scales` [T],
        dequantised on the device by `DFlashDataModule.on_after_batch_transfer`. Padding rows are zero.
        """
        values = torch.empty(token_budget, self.feature_dim, dtype=STORED[self.feature_format])
        scales = torch.empty(token_budget, dtype=torch.float32) if self.feature_format == "fp8" else None
        start = 0
        for i in row:
            doc = self.document(i)
            end = start + doc["features"].shape[0]
            values[start:end] = doc["features"]
            if scales is not None:
                scales[start:end] = doc["scales"]
            start = end
        values[start:].view(torch.uint8).zero_()  # fp8 has no zero_ kernel; zero bytes are 0.0 in both formats
        if scales is None:
            return {"context_features": values}
        scales[start:] = 0.0
        return {"context_features_fp8": values, "context_scales": scales}


class FeatureCache:
    """A finished feature cache folder: its manifest, checks against a run, and readers per split."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        path = self.folder / MANIFEST
        if not path.exists():
            raise FeatureCacheError(f"feature cache {self.folder}: no {MANIFEST} (make one with "
                                    "python -m dflash_lightning cache --config ... --out ...)")
        self.manifest: dict[str, Any] = json.loads(path.read_text())
        if not self.manifest.get("complete"):
            done = sum(s["sha256"] is not None for sp in self.manifest["splits"].values() for s in sp["shards"])
            total = sum(len(sp["shards"]) for sp in self.manifest["splits"].values())
            raise FeatureCacheError(f"feature cache {self.folder} is incomplete ({done} of {total} shards): run "
                                    "python -m dflash_lightning cache again with the same arguments to finish it")

    @property
    def feature_format(self) -> FeatureFormat:
        return self.manifest["feature_format"]

    def check(self, expected: dict[str, Any]) -> None:
        """Raise `FeatureCacheError` naming the first compared field where the cache differs from `expected`."""
        compare_headers(self.folder, self.manifest, {"version": VERSION, **expected}, COMPARED)
        for split in expected.get("splits", {}):
            if split not in self.manifest["splits"]:
                raise FeatureCacheError(f"feature cache {self.folder} has no '{split}' split "
                                        f"(it has {sorted(self.manifest['splits'])})")

    def split(self, name: str) -> SplitFeatures:
        """The reader of one split; every shard's size and header are checked now."""
        shards = self.manifest["splits"][name]["shards"]
        reader = SplitFeatures(self.folder, shards, self.feature_format, self.manifest["feature_dim"])
        for k in range(len(shards)):
            reader.shard(k)
        reader._open.clear()  # checked; workers map them again
        return reader

    def verify(self) -> None:
        """Recompute every shard's sha256 against the manifest (reads the whole cache)."""
        for split in self.manifest["splits"].values():
            for shard in split["shards"]:
                path = self.folder / shard["file"]
                Shard(path, shard["bytes"])
                if sha256_path(path) != shard["sha256"]:
                    raise FeatureCacheError(f"feature cache shard {path} is corrupt: its sha256 differs from "
                                            "the manifest's")


# --------------------------------------------------------------------- writing with Lightning's predict loop


class _ForwardRows(Dataset):
    """This rank's shards as target forward rows: consecutive samples up to `forward_tokens` per row."""

    def __init__(self, shards: list[dict[str, Any]], samples: dict[str, TokenizedSamples], forward_tokens: int):
        self.rows = []
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
        self.samples = samples

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, k: int) -> dict[str, Any]:
        split, shard, docs, last = self.rows[k]
        ids = [self.samples[split].document(i)[0] for i in docs]
        return {"input_ids": torch.cat(ids).long(),
                "position_ids": torch.cat([torch.arange(len(x)) for x in ids]),  # restarts mark documents
                "split": split, "shard": shard["file"], "last": last}


class FeatureModule(LightningModule):
    """The frozen target in the predict loop: a forward row in, its context features out (bf16 or fp8)."""

    allow_zero_length_dataloader_with_multiple_devices = True  # a rank may have no shard left to write

    def __init__(self, path: str, layer_ids: list[int], dtype: str, attn_implementation: str,
                 feature_format: FeatureFormat) -> None:
        super().__init__()
        self.path, self.layer_ids, self.dtype_name = path, list(layer_ids), dtype
        self.attn_implementation, self.feature_format = attn_implementation, feature_format
        self.extractor: FeatureExtractor | None = None

    def configure_model(self) -> None:
        if self.extractor is None:
            self.extractor = FeatureExtractor.from_pretrained(
                self.path, self.layer_ids, DTYPES[self.dtype_name], self.trainer.strategy.root_device,
                self.attn_implementation,
            )

    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, Tensor]:
        features = self.extractor(batch["input_ids"], batch["position_ids"])  # [row tokens, K*H]
        if self.feature_format == "fp8":
            values, scales = quantize_fp8(features)  # on the device: it moves half the bytes to the host
            return {"features": values.cpu(), "scales": scales.cpu()}
        return {"features": features.to(torch.bfloat16).cpu()}


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
                   forward_tokens: int) -> tuple[dict[str, Any], dict[str, TokenizedSamples]]:
    """The manifest of a cache of `dm`'s samples (train, and val if it has val files) with the shard plan."""
    splits = {"train": (dm.train_paths, dm.samples("train"))}
    if dm.val_paths:
        splits["val"] = (dm.val_paths, dm.samples("val"))
    feature_dim = len(layer_ids) * hidden_size
    per_token = feature_dim * STORED[feature_format].itemsize + 4 + 1 + (4 if feature_format == "fp8" else 0)
    header = {"version": VERSION, "feature_format": feature_format, "feature_dim": feature_dim,
              **target_header(target, layer_ids, hidden_size), **data_header(dm, splits),
              "writing": {"shard_bytes": shard_bytes, "forward_tokens": forward_tokens}}
    header["target"]["dtype"] = target_dtype
    for split, (_, samples) in splits.items():
        header["splits"][split]["shards"] = plan_shards(split, samples.lengths(), per_token, shard_bytes)
    return header, {split: samples for split, (_, samples) in splits.items()}


def write_cache(
    dm: DFlashDataModule, target: str, layer_ids: Sequence[int], hidden_size: int, out: str | Path,
    feature_format: FeatureFormat = "bf16", target_dtype: str = "bfloat16", attn_implementation: str = "sdpa",
    shard_bytes: int = 1_000_000_000, forward_tokens: int | None = None, trainer_kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Runs the target over `dm`'s samples with `Trainer.predict` and writes (or finishes) the cache; the manifest."""
    from lightning.pytorch.callbacks import RichProgressBar

    folder = Path(out)
    forward_tokens = forward_tokens or dm.token_budget
    manifest, samples = cache_manifest(dm, target, target_dtype, layer_ids, hidden_size, feature_format,
                                       shard_bytes, forward_tokens)
    module = FeatureModule(target, list(layer_ids), target_dtype, attn_implementation, feature_format)
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


# ------------------------------------------------------------------------------------------------ CLI


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m dflash_lightning cache --config fit.yaml --out DIR [--format bf16|fp8] [--verify true]`."""
    from dflash_lightning.cli import DFlashCLI
    from dflash_lightning.data import DFlashDataModule
    from dflash_lightning.module import DFlashModule

    class CacheCLI(DFlashCLI):
        """The fit command's parser (same config file and overrides) plus the cache's own arguments."""

        def add_arguments_to_parser(self, parser) -> None:
            super().add_arguments_to_parser(parser)
            parser.add_argument("--out", type=str, required=True, help="Folder of the feature cache.")
            parser.add_argument("--format", type=FeatureFormat, default="bf16",
                                help="bf16, or fp8 (e4m3 with a float32 scale per token: half the bytes).")
            parser.add_argument("--shard_gb", type=float, default=1.0, help="Feature bytes per shard, in GB.")
            parser.add_argument("--forward_tokens", type=int | None, default=None,
                                help="Tokens per target forward (consecutive samples); None: data.token_budget.")
            parser.add_argument("--verify", type=bool, default=False,
                                help="Only check an existing cache against the config and every shard's sha256.")

        def instantiate_trainer(self, **kwargs: Any) -> None:  # type: ignore[override]
            return None  # the cache makes its own predict Trainer from the trainer section

    cli = CacheCLI(DFlashModule, DFlashDataModule, args=None if argv is None else list(argv), run=False,
                   save_config_kwargs={"overwrite": True}, auto_configure_optimizers=False)
    config, dm, module = cli.config, cli.datamodule, cli.model
    target = cli.config_init["target"]
    drafter = module.drafter_config
    if config.verify:
        cache = FeatureCache(config.out)
        splits = {"train": (dm.train_paths, dm.samples("train"))}
        if dm.val_paths:
            splits["val"] = (dm.val_paths, dm.samples("val"))
        cache.check(target_header(target.path, drafter.target_layer_ids, drafter.hidden_size) | data_header(dm, splits))
        cache.verify()
        print(f"feature cache {config.out}: matches the config, every shard's sha256 verified")
        return
    trainer_cfg = config.trainer
    write_cache(
        dm, target.path, drafter.target_layer_ids, drafter.hidden_size, config.out, config.format, target.dtype,
        target.attn_implementation, int(config.shard_gb * 1e9), config.forward_tokens,
        {"accelerator": trainer_cfg.accelerator, "devices": trainer_cfg.devices, "num_nodes": trainer_cfg.num_nodes},
    )


__all__ = ["FeatureCache", "FeatureCacheError", "dequantize", "quantize_fp8", "write_cache"]
