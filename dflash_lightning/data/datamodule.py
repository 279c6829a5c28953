"""`DFlashDataModule`: conversation files -> tokenized samples (in `setup`) -> one packed fixed-shape row
per batch, repacked every epoch, resumable mid-epoch (on any number of ranks) through `state_dict`; with
`feature_cache`, every batch also carries the target's context features read from a cache (feature_cache.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch import LightningDataModule
from lightning.pytorch.trainer.states import TrainerFn
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from dflash_lightning.blocks import anchor_seed
from dflash_lightning.data.conversations import (
    DataError,
    TokenizedSamples,
    resolve_files,
    tokenize_files,
)
from dflash_lightning.data.feature_cache import FeatureCache, SplitFeatures, data_header, dequantize, target_header
from dflash_lightning.data.packing import (
    EpochPacker,
    PackedBatch,
    collate_documents,
    pack_documents,
    padding_fraction,
    shard_rows,
)
from dflash_lightning.long_runs import lightning_compat as compat
from dflash_lightning.target_model.loading import load_target_config
from dflash_lightning.target_model.wiring import check_wiring

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


log = logging.getLogger(__name__)

CACHE_VERSION = 2  # bump when tokenization changes meaning, so old caches are not reused (2: record locations)


def _rank_zero(level: int, message: str) -> None:
    if getattr(rank_zero_only, "rank", 0) == 0:
        log.log(level, message)


class _Rows:
    """Collates packed rows of tokenized documents into `PackedBatch`es (with cached features if given).

    Every batch also carries `anchor_seed` (int64, 0-d): its anchor draw, keyed by its place in the stream.
    """

    def __init__(self, samples: TokenizedSamples, token_budget: int, max_documents: int, pad_id: int,
                 features: SplitFeatures | None = None, seed: int = 0) -> None:
        self.samples = samples
        self.token_budget = token_budget
        self.max_documents = max_documents
        self.pad_id = pad_id
        self.features = features
        self.seed = seed

    def collate(self, row: list[int], split: str, epoch: int, index: int) -> PackedBatch:
        docs = [self.samples.document(i) for i in row]
        batch = collate_documents(docs, self.token_budget, self.max_documents, self.pad_id)
        # the documents' sample indices (-1 padded to D): a batch that goes wrong can name its records
        batch["sample_ids"] = torch.full((self.max_documents,), -1, dtype=torch.int64)  # type: ignore[typeddict-unknown-key]
        batch["sample_ids"][: len(row)] = torch.tensor(row, dtype=torch.int64)  # type: ignore[typeddict-item]
        if self.features is not None:
            batch.update(self.features.packed(row, self.token_budget))  # type: ignore[typeddict-item]
        seed = anchor_seed(self.seed, split, epoch, index)
        batch["anchor_seed"] = torch.tensor(seed, dtype=torch.int64)  # type: ignore[typeddict-unknown-key]
        return batch


class _ValRows(_Rows, Dataset):
    """Map-style: row i of a fixed packing (Lightning shards it across processes with its sampler)."""

    def __init__(self, rows: list[list[int]], *args: Any) -> None:
        super().__init__(*args)
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> PackedBatch:
        return self.collate(self.rows[i], "val", 0, i)  # the same anchors at every validation


class _TrainRows(_Rows, IterableDataset):
    """The rows this process serves in the current pass; `_TrainLoader` sets them before each pass."""

    def __init__(self, length: int, *args: Any) -> None:
        super().__init__(*args)
        self.length = length  # batches per epoch and process, the same in every epoch
        self.epoch = 0
        self.rows: list[tuple[int, list[int]]] = []  # (index in the epoch's global stream, row)

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[PackedBatch]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        # round-robin over workers is the order in which the DataLoader collects them: order is kept
        for j in range(worker, len(self.rows), workers):
            index, row = self.rows[j]
            yield self.collate(row, "train", self.epoch, index)


class _TrainLoader(DataLoader):
    """Asks the datamodule, in the main process, which rows to serve before every pass, and counts batches."""

    def __init__(self, datamodule: DFlashDataModule, dataset: _TrainRows, **kwargs: Any) -> None:
        super().__init__(dataset, batch_size=None, **kwargs)
        self.datamodule = datamodule

    def __iter__(self) -> Iterator[PackedBatch]:  # type: ignore[override]
        self.dataset.epoch, self.dataset.rows = self.datamodule._begin_train_pass()  # type: ignore[attr-defined]
        for batch in super().__iter__():
            self.datamodule._count_train_batch(batch)
            yield batch
        self.datamodule._end_train_pass()

    # Stateful like the datamodule (same state), so that Lightning knows this loader resumes mid-epoch
    def state_dict(self) -> dict[str, int]:
        return self.datamodule.state_dict()

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.datamodule.load_state_dict(state_dict)


class DFlashDataModule(LightningDataModule):
    """Chat conversations -> assistant-masked tokens -> one packed row of `token_budget` tokens per batch.

    A batch is a `PackedBatch` dict of CPU tensors: `input_ids` int64 [T], `position_ids` int64 [T],
    `doc_ids` int32 [T] (-1 on padding), `loss_mask` bool [T], `doc_lengths` int32 [D].

    Args:
        train_files: Training data: .jsonl/.json (JSON lines), .parquet, `save_to_disk` folders or globs.
        val_files: Validation data in the same forms; None for no validation.
        tokenizer: The target's tokenizer, a local folder or hub id; its chat template renders the records.
        format: Record format: OpenAI "messages", ShareGPT "conversations", or "auto" to detect per record.
        enable_thinking: Passed to the chat template as `enable_thinking` when not None.
        token_budget: Tokens per packed row, T; every batch has exactly this many.
        max_documents: Most documents in one packed row, D (the length of `doc_lengths`).
        max_length: Conversations are truncated to this many tokens; None means token_budget.
        block_size: Drafter block size.
        min_supervised_tokens: Samples with fewer supervised tokens are dropped; None: 2 * block_size (a full
            block and its anchor), at least 2 (one anchor and the token after it).
        shuffle_buffer: Documents per best-fit-decreasing packing buffer.
        seed: Shuffling seed; epoch e packs with seed + e.
        num_workers: DataLoader worker processes that collate rows.
        on_bad_record: "error" raises on the first bad record; "skip" drops bad records and logs counts.
        val_batches: Most validation batches (packed rows, over all processes); None for all.
        cache_dir: Folder for tokenized samples, written in `prepare_data` and reused while inputs are unchanged.
        feature_cache: Folder written by `python -m dflash_lightning cache`: batches then carry
            `context_features` [T, K*H] read from it, and the run needs no target (leave out the `target`
            callback). The cache must match the data, tokenizer, settings, target and layer ids (checked in setup).
        target: With `feature_cache`: the target whose features the cache must hold (linked from `target.path`).
        target_layer_ids: With `feature_cache`: the target layers of the features, the drafter's `target_layer_ids`
            (linked from the model); None: the cache's target and layers are not checked.
        final_hidden: With `feature_cache`: also serve the target's final hidden states, distillation's teacher
            (linked: whether `model.objective` distills).
        accept_target_change: Read a cache made with other target weights on purpose, with one logged line
            (linked from `model.accept_target_change`).
    """

    def __init__(
        self,
        train_files: list[str],
        val_files: list[str] | None = None,
        tokenizer: str = "",
        format: Literal["auto", "messages", "sharegpt"] = "auto",
        enable_thinking: bool | None = None,
        token_budget: int = 8192,
        max_documents: int = 64,
        max_length: int | None = None,
        block_size: int = 16,
        min_supervised_tokens: int | None = None,
        shuffle_buffer: int = 1024,
        seed: int = 0,
        num_workers: int = 0,
        on_bad_record: Literal["error", "skip"] = "error",
        val_batches: int | None = None,
        cache_dir: str | None = None,
        feature_cache: str | None = None,
        target: str | None = None,
        target_layer_ids: list[int] | None = None,
        final_hidden: bool = False,
        accept_target_change: bool = False,
    ) -> None:
        super().__init__()
        # the drafter's values, recorded in checkpoints as the model's: not again as data settings
        self.save_hyperparameters(ignore=["target", "target_layer_ids", "final_hidden", "accept_target_change"])
        self.target = target
        self.target_layer_ids = list(target_layer_ids) if target_layer_ids is not None else None
        self.final_hidden, self.accept_target_change = final_hidden, accept_target_change
        if max_length is None:
            max_length = token_budget
        for ok, message in (
            (isinstance(train_files, (list, tuple)) and train_files, f"train_files must list files: {train_files!r}"),
            (val_files is None or isinstance(val_files, (list, tuple)), f"val_files must be a list, got {val_files!r}"),
            (bool(tokenizer), f"tokenizer must be a local tokenizer folder or hub id, got {tokenizer!r}"),
            (format in ("auto", "messages", "sharegpt"), f"format must be auto, messages or sharegpt, got {format!r}"),
            (enable_thinking in (None, True, False), f"enable_thinking must be bool or null, got {enable_thinking!r}"),
            (block_size >= 1, f"block_size must be >= 1, got {block_size}"),
            (token_budget >= block_size, f"token_budget must be >= block_size ({block_size}), got {token_budget}"),
            (max_documents >= 1, f"max_documents must be >= 1, got {max_documents}"),
            (max_length <= token_budget, f"max_length must be <= token_budget ({token_budget}), got {max_length}"),
            (max_length >= 2 * block_size, f"max_length must be >= 2 * block_size ({2 * block_size}) got {max_length}"),
            (min_supervised_tokens is None or min_supervised_tokens >= 2,
             f"min_supervised_tokens must be >= 2 or null, got {min_supervised_tokens}"),
            (shuffle_buffer >= 1, f"shuffle_buffer must be >= 1, got {shuffle_buffer}"),
            (num_workers >= 0, f"num_workers must be >= 0, got {num_workers}"),
            (on_bad_record in ("error", "skip"), f"on_bad_record must be error or skip, got {on_bad_record!r}"),
            (val_batches is None or val_batches >= 1, f"val_batches must be >= 1 or null, got {val_batches}"),
        ):
            if not ok:
                raise ValueError(message)
        self.train_paths = resolve_files(train_files, "train_files")
        self.val_paths = resolve_files(val_files or [], "val_files")
        self.token_budget = token_budget
        self.max_documents = max_documents
        self.max_length = max_length
        self.min_supervised = min_supervised_tokens or 2 * block_size  # an anchor p needs p and p+1 supervised
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self.train_samples: TokenizedSamples | None = None
        self.val_samples: TokenizedSamples | None = None
        self._features: dict[str, SplitFeatures] = {}  # split -> cached context features, with feature_cache
        self._packer: EpochPacker | None = None
        self._val_rows: list[list[int]] | None = None
        # the position of the training stream: epoch and batches served in it (what state_dict saves)
        self._epoch = 0
        self._served = 0
        self._resume: dict[str, int] | None = None
        self._stats: Counter[str] = Counter()

    # ------------------------------------------------------------------------------------ tokenizing

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The target tokenizer, loaded on first use."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            try:
                self._tokenizer = AutoTokenizer.from_pretrained(self.hparams.tokenizer)
            except (OSError, ValueError) as err:
                raise DataError(self.hparams.tokenizer, "could not load tokenizer", str(err)) from err
        return self._tokenizer

    @property
    def pad_id(self) -> int:
        """Token id on padding: the tokenizer's pad id, or 0 if it has none."""
        pad = self.tokenizer.pad_token_id
        return 0 if pad is None else int(pad)

    def prepare_data(self) -> None:
        """With `cache_dir`, tokenizes once per node so that every process's `setup` only loads."""
        if self.hparams.cache_dir is not None:
            for split, paths in (("train", self.train_paths), ("val", self.val_paths)):
                if paths and not self._cache_path(split, paths).exists():
                    self._load_split(split, paths)

    def setup(self, stage: str | None = None) -> None:
        """Reads and tokenizes the data of `stage`; every bad input raises here, before any model compute."""
        splits = []
        if stage in (None, "fit"):
            splits.append("train")
        if stage in (None, "fit", "validate") and self.val_paths:
            splits.append("val")
        for split in splits:
            self.samples(split)
        module = self.trainer.lightning_module if self.trainer is not None else None
        if hasattr(module, "drafter_config"):  # values given by hand must agree with the module's
            check_wiring(module, self)
            self.check_mask_absent(module.drafter_config.mask_token_id, splits)
        if self.hparams.feature_cache is not None:
            reader = module.final_hidden_reason() if hasattr(module, "final_hidden_reason") else "data.final_hidden"
            self._open_feature_cache([s for s in splits if s not in self._features], reader)

    def check_mask_absent(self, mask_token_id: int, splits: list[str]) -> None:
        """Refuse data holding the drafter's MASK token: a block's MASK slots would look like that data token."""
        for split in splits:
            where = self.samples(split).find(mask_token_id)
            if where is not None:
                text = self.tokenizer.convert_ids_to_tokens(mask_token_id)
                raise DataError(where, f"holds token {mask_token_id} ({text!r}), the drafter's MASK",
                                "set model.drafter.mask_token_id to a token the data never holds "
                                "(docs/method.md section 3)")

    def samples(self, split: Literal["train", "val"]) -> TokenizedSamples:
        """The tokenized samples of a split, read and tokenized (or loaded from `cache_dir`) on first use."""
        if split == "train":
            if self.train_samples is None:
                self.train_samples = self._load_split("train", self.train_paths)
            return self.train_samples
        if self.val_samples is None:
            self.val_samples = self._load_split("val", self.val_paths)
        return self.val_samples

    def _open_feature_cache(self, splits: list[str], reader: str = "data.final_hidden") -> None:
        """Checks the cache against this data (and the target's layers, if given) and opens its splits; `reader`: the
        setting that reads the final hidden states, named where the cache lacks them."""
        if not splits:
            return
        cache = FeatureCache(self.hparams.feature_cache)
        paths = {"train": self.train_paths, "val": self.val_paths}
        expected = data_header(self, {s: (paths[s], self.samples(s)) for s in splits})
        if self.target_layer_ids is not None:  # the features must be those of the drafter's target and layers
            if not self.target:
                raise ValueError("data.target: needed with data.target_layer_ids, to check the feature cache's target")
            hidden = load_target_config(self.target).hidden_size  # the drafter's too (it shares the target's head)
            expected |= target_header(self.target, self.target_layer_ids, hidden)
        cache.check(expected, self.accept_target_change)
        for split in splits:
            self._features[split] = cache.split(split, self.final_hidden, reader)
        _rank_zero(logging.INFO, f"context features of {', '.join(splits)} from {cache.folder} "
                   f"({cache.feature_format}, {cache.manifest['feature_dim']} per token)")

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """Moves the batch, but the anchor seed stays on the host, so that seeding the step's generator never syncs."""
        seed = batch.pop("anchor_seed", None) if isinstance(batch, dict) else None
        batch = super().transfer_batch_to_device(batch, device, dataloader_idx)
        if seed is not None:
            batch["anchor_seed"] = seed
        return batch

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """fp8 cached features are dequantised here, on the device: half the bytes cross the host link."""
        if isinstance(batch, dict) and "context_features_fp8" in batch:
            batch["context_features"] = dequantize(batch.pop("context_features_fp8"), batch.pop("context_scales"))
        return batch

    def _load_split(self, split: str, paths: list[Path]) -> TokenizedSamples:
        cache = self._cache_path(split, paths) if self.hparams.cache_dir is not None else None
        if cache is not None and cache.exists():
            samples = TokenizedSamples(**torch.load(cache, weights_only=True))
            _rank_zero(logging.INFO, f"{split}: loaded tokenized samples from {cache}")
        else:
            samples = tokenize_files(
                paths, self.tokenizer, self.hparams.tokenizer, self.hparams.format, self.hparams.enable_thinking,
                self.max_length, self.min_supervised, self.hparams.on_bad_record,
            )
            if cache is not None:
                cache.parent.mkdir(parents=True, exist_ok=True)
                tmp = cache.with_suffix(f".{os.getpid()}.tmp")
                torch.save(vars(samples), tmp)
                os.replace(tmp, cache)  # atomic: a concurrent reader never sees half a file
        _rank_zero(logging.WARNING if samples.dropped else logging.INFO, samples.report(split, self.min_supervised))
        if len(samples) == 0:
            report = samples.report(split, self.min_supervised)
            raise DataError(", ".join(map(str, paths)), f"no usable {split} samples", report)
        return samples

    def _cache_path(self, split: str, paths: list[Path]) -> Path:
        """Cache file named by a hash of everything that changes the tokenized samples."""
        tok = self.tokenizer
        backend = getattr(tok, "backend_tokenizer", None)
        key = {
            "version": CACHE_VERSION,
            "files": [(str(p.resolve()), *_file_signature(p)) for p in paths],
            "tokenizer": backend.to_str() if backend is not None else tok.name_or_path,
            "chat_template": tok.chat_template,
            **{k: self.hparams[k] for k in ("format", "enable_thinking", "block_size", "on_bad_record")},
            "max_length": self.max_length,
            "min_supervised_tokens": self.min_supervised,
        }
        digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
        return Path(self.hparams.cache_dir) / f"{split}-{digest}.pt"

    # ------------------------------------------------------------------------------------ loaders

    def train_dataloader(self) -> DataLoader:
        """One `PackedBatch` per step; the documents are repacked every epoch."""
        samples = self._require(self.train_samples, "train")
        _, world_size = self._rank_and_world_size()
        # rows per epoch are a multiple of the global batch: every layout of that batch ends the epoch alike
        global_batch = world_size * (self.trainer.accumulate_grad_batches if self.trainer is not None else 1)
        if self._packer is None or self._packer.multiple_of != global_batch:
            self._packer = EpochPacker(
                samples.lengths(), self.token_budget, self.max_documents, self.hparams.shuffle_buffer,
                self.hparams.seed, multiple_of=global_batch,
            )
        length = math.ceil(self._packer.rows_per_epoch / world_size)
        dataset = _TrainRows(
            length, samples, self.token_budget, self.max_documents, self.pad_id, self._features.get("train"),
            self.hparams.seed,
        )
        return _TrainLoader(
            self, dataset, num_workers=self.hparams.num_workers, pin_memory=torch.cuda.is_available()
        )

    def val_dataloader(self) -> DataLoader | list[DataLoader]:
        """Packed rows of the validation files in file order, the same every time; [] without val_files."""
        if not self.val_paths:
            return []
        samples = self._require(self.val_samples, "val")
        if self._val_rows is None:
            lengths = samples.lengths()
            rows = pack_documents(lengths, self.token_budget, self.max_documents, self.hparams.shuffle_buffer, None)
            self._val_rows = rows[: self.hparams.val_batches]
        dataset = _ValRows(
            self._val_rows, samples, self.token_budget, self.max_documents, self.pad_id, self._features.get("val"),
            self.hparams.seed,
        )
        return DataLoader(
            dataset, batch_size=None, shuffle=False, num_workers=self.hparams.num_workers,
            pin_memory=torch.cuda.is_available(),
        )

    def _require(self, samples: TokenizedSamples | None, split: str) -> TokenizedSamples:
        if samples is None:
            raise RuntimeError(f"DFlashDataModule: call setup() before the {split} dataloader")
        return samples

    def _rank_and_world_size(self) -> tuple[int, int]:
        if self.trainer is not None:
            return self.trainer.global_rank, self.trainer.world_size
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank(), torch.distributed.get_world_size()
        return 0, 1

    def _fitting(self) -> bool:
        return self.trainer is not None and self.trainer.state.fn == TrainerFn.FITTING

    # ------------------------------------------------------------------------ the training stream

    def _begin_train_pass(self) -> tuple[int, list[tuple[int, list[int]]]]:
        """The epoch and the (global index, row)s this process serves in this pass, from the resume point on.

        The epoch's packing is one global stream; rank r of W takes rows r, r + W, ... of it, and the resume
        point counts rows of that stream, so a run resumes on another number of ranks where it stopped.
        """
        assert self._packer is not None and self.train_samples is not None
        # the trainer's epoch is the truth when fitting (it survives restarts); alone we count passes
        epoch = self.trainer.current_epoch if self._fitting() else self._epoch
        rank, world_size = self._rank_and_world_size()
        start = 0
        if self._resume is not None:
            resume, self._resume = self._resume, None
            if resume["epoch"] == epoch:  # a resume point of another epoch is stale: that epoch had ended
                start = resume["rows_served"]
            if start % world_size:
                raise RuntimeError(
                    f"the checkpoint stopped after {start} rows of epoch {epoch}, which {world_size} ranks cannot "
                    f"share evenly: resume on a number of ranks that divides {start}"
                )
            if resume.get("documents", len(self.train_samples)) != len(self.train_samples):
                _rank_zero(logging.WARNING, f"training data has {len(self.train_samples)} samples, the checkpoint "
                           f"had {resume['documents']}; batches are resumed by position in a different packing")
        rows = self._packer.rows(epoch)
        tokens = self.train_samples.input_ids.numel()
        _rank_zero(
            logging.INFO,
            f"epoch {epoch}: {len(self.train_samples):,} documents packed into {len(rows):,} rows of "
            f"{self.token_budget} tokens, {len(self.train_samples) / max(1, len(rows)):.1f} documents per row, "
            f"{padding_fraction(len(rows), tokens, self.token_budget):.2%} padding"
            + (f"; resuming after {start} rows ({start // world_size} batches per rank)" if start else ""),
        )
        self._epoch, self._served = epoch, start // world_size
        return epoch, shard_rows(list(enumerate(rows)), rank, world_size)[start // world_size:]

    def _count_train_batch(self, batch: PackedBatch) -> None:
        self._served += 1
        tokens = int(batch["doc_lengths"].sum())
        self._stats["rows"] += 1
        self._stats["documents"] += int((batch["doc_lengths"] > 0).sum())
        self._stats["tokens"] += tokens
        self._stats["padding_tokens"] += self.token_budget - tokens
        self._stats["supervised_tokens"] += int(batch["loss_mask"].sum())

    def _end_train_pass(self) -> None:
        self._epoch, self._served = self._epoch + 1, 0
        s = self.packing_stats()
        _rank_zero(
            logging.INFO,
            f"packing so far: {s['rows']:,} rows, {s['documents_per_row']:.2f} documents per row, "
            f"{s['padding_fraction']:.2%} padding, {s['supervised_tokens'] / max(1, s['tokens']):.1%} supervised",
        )

    def train_locations(self, sample_ids: list[int]) -> list[str]:
        """File and line (or row) of the training records with these sample indices (`batch["sample_ids"]`)."""
        samples = self._require(self.train_samples, "train")
        return [samples.location(i) for i in sample_ids]

    def packing_stats(self) -> dict[str, float]:
        """Running totals over the training batches served so far, with the fraction of padded tokens."""
        keys = ("rows", "documents", "tokens", "padding_tokens", "supervised_tokens")
        stats: dict[str, float] = {k: self._stats[k] for k in keys}
        rows = self._stats["rows"]
        stats["padding_fraction"] = padding_fraction(rows, self._stats["tokens"], self.token_budget)
        stats["documents_per_row"] = self._stats["documents"] / rows if rows else 0.0
        return stats

    def state_dict(self) -> dict[str, int]:
        """Epoch and rows of its global stream already trained on (over all ranks), so a resume takes the next."""
        epoch, served = self._epoch, self._served
        if self._fitting():
            # the loader runs ahead of the step (Lightning prefetches); count the batches the loop processed
            epoch = self.trainer.current_epoch
            served = compat.processed_batches(self.trainer)
        documents = len(self.train_samples) if self.train_samples is not None else -1
        _, world_size = self._rank_and_world_size()
        return {"epoch": epoch, "rows_served": served * world_size, "world_size": world_size, "documents": documents}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Continue the training stream from a `state_dict()`."""
        state = {k: int(v) for k, v in state_dict.items()}
        if "rows_served" not in state:  # written before positions were global: a count of this rank's batches
            state["rows_served"] = state.pop("batches_served") * self._rank_and_world_size()[1]
        _, world_size = self._rank_and_world_size()
        self._epoch, self._served = state["epoch"], state["rows_served"] // world_size
        self._resume = {k: v for k, v in state.items() if v >= 0}


def _file_signature(path: Path) -> tuple[int, int]:
    """Size and modification time of a file, summed over a folder's files."""
    files = [f for f in path.rglob("*") if f.is_file()] if path.is_dir() else [path]
    stats = [f.stat() for f in files]
    return sum(s.st_size for s in stats), max((s.st_mtime_ns for s in stats), default=0)
