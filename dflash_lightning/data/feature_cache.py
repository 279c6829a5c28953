"""The feature cache's format and reader: the target's context features (docs/method.md section 1) stored per sample
in sharded safetensors with a manifest of everything they depend on, read back by `DFlashDataModule`.

The writer is `feature_cache_writer.py` (`python -m dflash_lightning cache`).

Layout of `out/`:
    manifest.json             settings and fingerprints (see `cache_header`), shard plan, completed shards
    {split}-{i:05d}.safetensors   samples [first, end) of a split, laid end to end:
        features   [tokens, K*H] bf16, or float8_e4m3fn with `scales` [tokens] fp32 (row absmax / 448)
        input_ids  [tokens] int32;  loss_mask [tokens] bool;  starts [samples + 1] int64 (offsets in the shard)
        final_hidden  [tokens, H] bf16, the target's final normed hidden state (distillation's teacher, docs/method.md
            section 4c); only in a cache whose manifest has `final_hidden: true`
        crc32      [samples] int64: each sample's stored bytes, checked when a reader first serves the sample
    progress-rank{r}.json     shards a rank finished while the run is in progress (merged at the end)
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import warnings
import zlib
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor

from dflash_lightning.target_model.fingerprints import (
    check_same_target,
    sha256_path,
    target_fingerprint,
    tokenizer_sha256,
)

if TYPE_CHECKING:
    from lightning.pytorch import LightningDataModule

    from dflash_lightning.data.conversations import TokenizedSamples

log = logging.getLogger(__name__)

VERSION = 1
MANIFEST = "manifest.json"
FeatureFormat = Literal["bf16", "fp8"]
FP8_MAX = 448.0  # largest finite float8_e4m3fn
STORED = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn, "F32": torch.float32,
                      "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool}
MAX_OPEN_SHARDS = 64  # per process: each mapped shard holds a file descriptor, and a cache can have thousands


class FeatureCacheError(ValueError):
    """A feature cache that does not match the run, or a damaged one; the message names the field or shard."""




def samples_sha256(samples: TokenizedSamples) -> str:
    """Hash of the tokenized samples exactly as they are packed (ids, loss mask, document boundaries)."""
    digest = hashlib.sha256()
    for t in (samples.input_ids.to(torch.int32), samples.loss_mask.to(torch.uint8), samples.starts.to(torch.int64)):
        digest.update(t.contiguous().numpy().tobytes())
    return digest.hexdigest()


def data_header(dm: LightningDataModule, splits: dict[str, tuple[list[Path], TokenizedSamples]]) -> dict[str, Any]:
    """The manifest fields that the data module (a `DFlashDataModule`) decides: tokenizer, template, files, samples."""
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


# Fields a reader compares (dotted paths; `*` is every split of the run). Paths and sizes are informational; the
# target's weights_fingerprint is checked on its own (`check_same_target`), after these.
COMPARED = (
    "version", "target.config_sha256", "target.layer_ids", "target.hidden_size",
    "tokenizer.sha256", "data.format", "data.enable_thinking", "data.max_length", "data.block_size",
    "data.min_supervised_tokens", "data.on_bad_record", "splits.*.files_sha256", "splits.*.num_samples",
    "splits.*.samples_sha256",
)
# ... and a resumed cache run also these, which decide the shards already written (one cache, one target: no override).
WRITER_COMPARED = ("feature_format", "final_hidden", "target.dtype", "target.weights_fingerprint",
                   "writing.shard_bytes", "writing.forward_tokens")


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




SAMPLE_FIELDS = ("features", "scales", "final_hidden", "input_ids", "loss_mask")  # what a crc32 covers, in order


def sample_crc32(tensors: dict[str, Tensor], a: int, b: int) -> int:
    """crc32 of the bytes of tokens [a, b) of every stored per-token tensor: one rule for the writer and reader."""
    crc = 0
    for name in SAMPLE_FIELDS:
        if name in tensors:
            crc = zlib.crc32(tensors[name][a:b].contiguous().view(torch.uint8).numpy(), crc)
    return crc


def sample_checksums(tensors: dict[str, Tensor]) -> Tensor:
    """The `crc32` tensor of a shard: `sample_crc32` of each sample that `starts` delimits, int64 [samples]."""
    starts = tensors["starts"].tolist()
    return torch.tensor([sample_crc32(tensors, a, b) for a, b in zip(starts[:-1], starts[1:], strict=True)],
                        dtype=torch.int64)


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
                warnings.filterwarnings("ignore", message="The given buffer is not writable")
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
                 feature_dim: int, hidden_size: int | None = None) -> None:
        """`hidden_size`: also read the stored final hidden states (a cache written with them)."""
        self.folder, self.shards = folder, shards
        self.feature_format, self.feature_dim, self.hidden_size = feature_format, feature_dim, hidden_size
        self.firsts = [s["first"] for s in shards]
        self._open: OrderedDict[int, Shard] = OrderedDict()  # least recently used first
        self._checked: dict[int, bytearray] = {}  # per shard, 1 for each sample whose crc32 this process checked

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
        """Views of sample i's stored tensors: features [n, K*H] (+ scales [n]), input_ids, loss_mask, and
        final_hidden [n, H] if this reader reads them; the bytes are checked against the sample's crc32 the first
        time this process serves the sample (flipped bytes are refused naming the shard; a crc32 pass costs about
        as much as the copy into a batch, so later epochs do not repeat it)."""
        k = bisect_right(self.firsts, i) - 1
        shard = self.shard(k).tensors
        starts = shard["starts"]
        j = i - self.firsts[k]
        a, b = int(starts[j]), int(starts[j + 1])
        checked = self._checked.setdefault(k, bytearray(len(starts) - 1))
        if "crc32" in shard and not checked[j]:
            if sample_crc32(shard, a, b) != int(shard["crc32"][j]):
                raise FeatureCacheError(
                    f"feature cache shard {self.folder / self.shards[k]['file']} is corrupt: sample {i} (tokens "
                    f"{a}..{b} of the shard) fails its crc32 check. Make the cache again (python -m dflash_lightning "
                    "cache)"
                )
            checked[j] = 1
        names = ("features", "scales", "input_ids", "loss_mask") if self.feature_format == "fp8" else (
            "features", "input_ids", "loss_mask")
        names += ("final_hidden",) if self.hidden_size else ()
        return {name: shard[name][a:b] for name in names}

    def packed(self, row: Sequence[int], token_budget: int) -> dict[str, Tensor]:
        """Features of the documents of a packed row, laid out as `collate_documents` lays out their tokens.

        bf16: `context_features` [T, K*H]; fp8: `context_features_fp8` [T, K*H] and `context_scales` [T],
        dequantised on the device by `DFlashDataModule.on_after_batch_transfer`. With `hidden_size`, also
        `final_hidden` [T, H] bf16. Padding rows are zero.
        """
        values = torch.empty(token_budget, self.feature_dim, dtype=STORED[self.feature_format])
        scales = torch.empty(token_budget, dtype=torch.float32) if self.feature_format == "fp8" else None
        final = torch.zeros(token_budget, self.hidden_size, dtype=torch.bfloat16) if self.hidden_size else None
        start = 0
        for i in row:
            doc = self.document(i)
            end = start + doc["features"].shape[0]
            values[start:end] = doc["features"]
            if scales is not None:
                scales[start:end] = doc["scales"]
            if final is not None:
                final[start:end] = doc["final_hidden"]
            start = end
        values[start:].view(torch.uint8).zero_()  # fp8 has no zero_ kernel; zero bytes are 0.0 in both formats
        out = {"final_hidden": final} if final is not None else {}
        if scales is None:
            return {"context_features": values, **out}
        scales[start:] = 0.0
        return {"context_features_fp8": values, "context_scales": scales, **out}


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

    def check(self, expected: dict[str, Any], accept_target_change: bool = False) -> None:
        """Raise `FeatureCacheError` naming the first compared field where the cache differs from `expected`, then
        `TargetChangedError` if its features come from other target weights (unless accepted)."""
        compare_headers(self.folder, self.manifest, {"version": VERSION, **expected}, COMPARED)
        if "target" in expected:
            check_same_target(self.manifest["target"].get("weights_fingerprint"),
                              expected["target"]["weights_fingerprint"], f"feature cache {self.folder}",
                              expected["target"]["path"], accept_target_change)
        for split in expected.get("splits", {}):
            if split not in self.manifest["splits"]:
                raise FeatureCacheError(f"feature cache {self.folder} has no '{split}' split "
                                        f"(it has {sorted(self.manifest['splits'])})")

    def split(self, name: str, final_hidden: bool = False, reader: str = "data.final_hidden") -> SplitFeatures:
        """The reader of one split (with the final hidden states if asked, for `reader`: the setting that reads them,
        named where the cache lacks them); every shard's size and header are checked now."""
        if final_hidden and not self.manifest.get("final_hidden"):
            raise FeatureCacheError(
                f"feature cache {self.folder} has no final_hidden (the target's final hidden states), which {reader} "
                "needs: make a cache with python -m dflash_lightning cache --final_hidden true"
            )
        shards = self.manifest["splits"][name]["shards"]
        hidden = self.manifest["target"]["hidden_size"] if final_hidden else None
        reader = SplitFeatures(self.folder, shards, self.feature_format, self.manifest["feature_dim"], hidden)
        for k in range(len(shards)):
            reader.shard(k)
        if shards and "crc32" not in reader.shard(0).tensors:
            log.warning(f"feature cache {self.folder} predates per-sample checksums: flipped bytes in a shard are "
                        "found only by `python -m dflash_lightning cache --verify true` (or make it again)")
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
