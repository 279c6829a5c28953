"""DFlashDataModule: argument checks, epochs of packed fixed-shape batches, sharding, validation,
caching, and mid-epoch resume both by hand and through a real Lightning Trainer checkpoint."""

from __future__ import annotations

import itertools
import logging
from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from test_data_conversations import chat, make_tokenizer, sharegpt, write_jsonl, write_with_bad_line

from dflash_lightning.data import DataError, DFlashDataModule

T, D = 256, 4


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, str]:
    """A tokenizer, 60 training conversations of varied length (3 too short to keep) and 12 validation ones."""
    root = tmp_path_factory.mktemp("dm")
    make_tokenizer(root / "tok")
    train = [chat(i, reply=2 if i % 20 == 0 else 10 + (37 * i) % 70, turns=1 + i % 2) for i in range(60)]
    write_jsonl(root / "train.jsonl", [{"messages": c} for c in train[:30]])
    write_jsonl(root / "train2.jsonl", [sharegpt(c) for c in train[30:]])
    write_jsonl(root / "val.jsonl", [{"messages": chat(100 + i, reply=40)} for i in range(12)])
    return {"tok": str(root / "tok"), "train": str(root / "train*.jsonl"), "val": str(root / "val.jsonl"),
            "root": str(root)}


def make_dm(data, **overrides) -> DFlashDataModule:
    kwargs = dict(train_files=[data["train"]], val_files=[data["val"]], tokenizer=data["tok"], token_budget=T,
                  max_documents=D, block_size=4, shuffle_buffer=16, seed=1)
    dm = DFlashDataModule(**(kwargs | overrides))
    dm.setup("fit")
    return dm


def docs_of(batch, pad_id: int = 257) -> list[tuple[tuple[int, ...], tuple[bool, ...]]]:
    """The documents of a packed batch, checking that every field agrees with `doc_lengths`."""
    lengths = [n for n in batch["doc_lengths"].tolist() if n > 0]
    used, budget = sum(lengths), batch["input_ids"].numel()
    assert batch["doc_lengths"].tolist() == lengths + [0] * (batch["doc_lengths"].numel() - len(lengths))
    want_doc = [d for d, n in enumerate(lengths) for _ in range(n)] + [-1] * (budget - used)
    want_pos = [p for n in lengths for p in range(n)] + list(range(budget - used))
    assert batch["doc_ids"].tolist() == want_doc and batch["position_ids"].tolist() == want_pos
    assert not batch["loss_mask"][used:].any() and (batch["input_ids"][used:] == pad_id).all()
    ends = list(itertools.accumulate(lengths))
    ids, mask = batch["input_ids"].tolist(), batch["loss_mask"].tolist()
    return [(tuple(ids[e - n : e]), tuple(mask[e - n : e])) for n, e in zip(lengths, ends, strict=True)]


def all_docs(dm) -> list:
    s = dm.train_samples
    return sorted((tuple(s.document(i)[0].tolist()), tuple(s.document(i)[1].tolist())) for i in range(len(s)))


def same(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"token_budget": 8}, r"token_budget must be >= block_size \(16\), got 8"),
        ({"max_length": 300}, r"max_length must be <= token_budget \(256\), got 300"),
        ({"max_length": 20}, r"max_length must be >= 2 \* block_size \(32\)"),
        ({"max_documents": 0}, "max_documents must be >= 1"),
        ({"format": "alpaca"}, "format must be"),
        ({"on_bad_record": "ignore"}, "on_bad_record must be"),
        ({"val_batches": 0}, "val_batches must be >= 1"),
        ({"shuffle_buffer": 0}, "shuffle_buffer must be >= 1"),
        ({"num_workers": -1}, "num_workers must be >= 0"),
        ({"min_supervised_tokens": 1}, "min_supervised_tokens must be >= 2"),
        ({"tokenizer": ""}, "tokenizer must be"),
        ({"train_files": []}, "train_files must list files"),
        ({"val_files": ["missing/val.jsonl"]}, r"missing/val\.jsonl: val_files: file does not exist"),
        ({"train_files": ["missing/*.parquet"]}, r"missing/\*\.parquet: train_files: no file matches"),
    ],
)
def test_init_validates_arguments(data, overrides, message):
    kwargs = dict(train_files=[data["train"]], tokenizer=data["tok"], token_budget=256, block_size=16) | overrides
    with pytest.raises(ValueError, match=message):
        DFlashDataModule(**kwargs)


def test_epoch_serves_every_sample_once_in_fixed_shapes(data, caplog):
    caplog.set_level(logging.INFO, logger="dflash_lightning")
    dm = make_dm(data)
    assert dm.pad_id == 257  # <|endoftext|>
    assert len(dm.train_samples) == 57  # 3 replies of 2 characters supervise fewer than 2 * block_size tokens
    assert "3 fewer than 8 supervised tokens (min_supervised_tokens)" in caplog.text
    loader = dm.train_dataloader()
    epochs = [list(loader) for _ in range(3)]
    for batches in epochs:
        assert len(batches) <= len(loader)
        for b in batches:
            assert {k: (tuple(v.shape), v.dtype) for k, v in b.items()} == {
                "input_ids": ((T,), torch.int64), "position_ids": ((T,), torch.int64),
                "doc_ids": ((T,), torch.int32), "loss_mask": ((T,), torch.bool), "doc_lengths": ((D,), torch.int32),
                "anchor_seed": ((), torch.int64),  # the batch's anchor draw, keyed by its place in the stream
                "sample_ids": ((D,), torch.int64),  # where the batch's records came from (-1 padded)
            }
            assert int((b["sample_ids"] >= 0).sum()) == int((b["doc_lengths"] > 0).sum())
        assert sorted(d for b in batches for d in docs_of(b)) == all_docs(dm)  # none lost, none duplicated
    assert not same(epochs[0], epochs[1]) and not same(epochs[1], epochs[2])  # reshuffled every epoch
    assert [m.split(":")[0] for m in caplog.messages if m.startswith("epoch ")] == ["epoch 0", "epoch 1", "epoch 2"]
    # deterministic for a seed, different for another
    again = make_dm(data).train_dataloader()
    assert all(same(list(again), batches) for batches in epochs)
    assert not same(list(make_dm(data, seed=2).train_dataloader()), epochs[0])
    # padding waste: running counters and one log line per epoch
    stats = dm.packing_stats()
    rows = sum(len(b) for b in epochs)
    real = sum(int(b["doc_lengths"].sum()) for batches in epochs for b in batches)
    assert stats["rows"] == rows and stats["tokens"] == real and stats["padding_tokens"] == rows * T - real
    assert stats["padding_fraction"] == pytest.approx(1 - real / (rows * T))
    assert stats["documents"] == 3 * 57 and stats["documents_per_row"] <= D


def test_max_documents_and_token_budget(data):
    dm = make_dm(data, max_documents=2, token_budget=512, max_length=300)
    for b in dm.train_dataloader():
        assert b["doc_lengths"].shape == (2,) and b["input_ids"].shape == (512,)
        assert int(b["doc_ids"].max()) <= 1


def test_resume_by_hand_continues_with_the_next_batch(data):
    full = make_dm(data).train_dataloader()
    epochs = [list(full) for _ in range(3)]
    dm = make_dm(data)
    loader = dm.train_dataloader()
    list(loader)  # epoch 0
    k = 3
    head = list(itertools.islice(iter(loader), k))  # part of epoch 1
    assert same(head, epochs[1][:k])
    state = dm.state_dict()
    assert state["epoch"] == 1 and state["rows_served"] == k
    resumed = make_dm(data)
    resumed.load_state_dict(state)
    loader = resumed.train_dataloader()
    assert same(list(loader), epochs[1][k:])
    assert same(list(loader), epochs[2])


class Recorder(LightningModule):
    """Records the batches it trains and validates on."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[tuple[int, torch.Tensor]] = []
        self.val_seen: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        self.seen.append((self.current_epoch, batch["input_ids"].clone()))
        return self.weight.sum() * batch["loss_mask"].sum()

    def validation_step(self, batch, batch_idx):
        self.val_seen.append(batch["input_ids"].clone())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def fit(dm, tmp_path: Path, ckpt_path: str | None = None, **kwargs) -> Recorder:
    model = Recorder()
    defaults = dict(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_progress_bar=False,
                    enable_model_summary=False, default_root_dir=tmp_path)
    trainer = Trainer(**(defaults | kwargs))
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    return model


def test_trainer_checkpoint_resume_continues_with_the_next_batch(data, tmp_path):
    dm = make_dm(data)
    per_epoch, val_rows = len(dm.train_dataloader()), len(dm.val_dataloader())
    full = fit(dm, tmp_path, enable_checkpointing=False, num_sanity_val_steps=0)
    assert [e for e, _ in full.seen] == [0] * per_epoch + [1] * per_epoch
    assert len(full.val_seen) == 2 * val_rows  # validation at the end of every epoch
    for k in (2, per_epoch, per_epoch + 3):  # mid-epoch 0, its last batch, mid-epoch 1
        ckpts = tmp_path / f"ckpt{k}"
        fit(make_dm(data), tmp_path, max_steps=k, num_sanity_val_steps=0,
            callbacks=[ModelCheckpoint(dirpath=ckpts, every_n_train_steps=k, save_top_k=-1)])
        (ckpt,) = ckpts.glob("*.ckpt")
        resumed = fit(make_dm(data), tmp_path, ckpt_path=str(ckpt), enable_checkpointing=False, num_sanity_val_steps=0)
        assert [e for e, _ in resumed.seen] == [e for e, _ in full.seen[k:]]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(resumed.seen, full.seen[k:], strict=True))


def test_fit_without_validation_files(data, tmp_path):
    dm = make_dm(data, val_files=None)
    assert dm.val_dataloader() == []
    model = fit(dm, tmp_path, max_epochs=1, enable_checkpointing=False)
    assert model.seen and not model.val_seen


def test_processes_get_disjoint_equal_shares(data):
    loaders = []
    for rank in range(3):
        dm = make_dm(data)
        dm._rank_and_world_size = lambda rank=rank: (rank, 3)
        loaders.append(dm.train_dataloader())
    for _ in range(2):  # epochs
        shares = [list(loader) for loader in loaders]
        assert [len(s) for s in shares] == [len(loader) for loader in loaders] == [len(shares[0])] * 3
        # the epoch's row count is a multiple of the process count: no row is served twice
        assert sorted(d for share in shares for b in share for d in docs_of(b)) == all_docs(dm)


def test_workers_keep_the_order(data):
    assert same(list(make_dm(data, num_workers=2).train_dataloader()), list(make_dm(data).train_dataloader()))


def test_validation_batches_fixed_and_limited(data):
    dm = make_dm(data, max_documents=2)
    first = list(dm.val_dataloader())
    assert len(first) == 6 and same(first, list(make_dm(data, max_documents=2).val_dataloader()))
    assert [docs_of(b)[0][0] for b in first[:1]] == [tuple(dm.val_samples.document(0)[0].tolist())]  # file order
    assert same(list(make_dm(data, max_documents=2, val_batches=2).val_dataloader()), first[:2])


def test_bad_input_raises_in_setup_naming_file_and_line(data, tmp_path, caplog):
    bad = write_with_bad_line(tmp_path / "bad.jsonl", '{"messages": [')
    dm = DFlashDataModule(train_files=[str(bad)], tokenizer=data["tok"], token_budget=T, block_size=4)
    with pytest.raises(DataError, match=r"bad\.jsonl:3: malformed JSON"):
        dm.setup("fit")
    caplog.set_level(logging.INFO, logger="dflash_lightning")
    dm = make_dm(data, train_files=[str(bad)], val_files=None, on_bad_record="skip")
    assert len(dm.train_samples) == 2 and f"1 bad record: malformed JSON (first: {bad}:3)" in caplog.text


def test_tokenizer_without_chat_template_raises_in_setup(data, tmp_path):
    make_tokenizer(tmp_path / "tok", template=None)
    dm = DFlashDataModule(train_files=[data["train"]], tokenizer=str(tmp_path / "tok"), token_budget=T, block_size=4)
    with pytest.raises(DataError, match="no chat_template"):
        dm.setup("fit")


def test_cache_dir(data, tmp_path, monkeypatch):
    dm = DFlashDataModule(train_files=[data["train"]], tokenizer=data["tok"], token_budget=T, block_size=4,
                          cache_dir=str(tmp_path / "cache"))
    dm.prepare_data()
    assert len(list((tmp_path / "cache").glob("train-*.pt"))) == 1
    dm.setup("fit")

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("should load from the cache")

    monkeypatch.setattr("dflash_lightning.data.datamodule.tokenize_files", no_tokenizing)
    cached = make_dm(data, val_files=None, cache_dir=str(tmp_path / "cache"))
    assert all(torch.equal(getattr(cached.train_samples, k), getattr(dm.train_samples, k))
               for k in ("input_ids", "loss_mask", "starts"))
    with pytest.raises(AssertionError, match="cache"):  # another max_length is another cache entry
        make_dm(data, val_files=None, cache_dir=str(tmp_path / "cache"), max_length=100)
    with pytest.raises(AssertionError, match="cache"):  # so is another minimum of supervised tokens
        make_dm(data, val_files=None, cache_dir=str(tmp_path / "cache"), min_supervised_tokens=2)


def test_min_supervised_tokens_keeps_short_replies(data):
    """The default minimum (2 * block_size = 8) drops 3 replies supervising 3 tokens; a minimum of 2 keeps them."""
    assert len(make_dm(data, val_files=None).train_samples) == 57
    assert len(make_dm(data, val_files=None, min_supervised_tokens=2).train_samples) == 60
