"""The separate-device feature prefetcher: order, bounded look-ahead, errors reach the trainer."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from dflash_lightning.target_model import FeaturePrefetcher


class FakeExtractor(nn.Module):
    def __init__(self, offset: float) -> None:
        super().__init__()
        self.offset = nn.Parameter(torch.tensor(offset), requires_grad=False)
        self.calls = 0

    def forward(self, input_ids, position_ids):
        self.calls += 1
        return input_ids.float()[:, None] + self.offset

    def extract(self, input_ids, position_ids):
        return {"context_features": self(input_ids, position_ids), "final_hidden": input_ids.float()[:, None]}


def batches(n: int):
    for i in range(n):
        yield {"input_ids": torch.full((4,), i), "position_ids": torch.arange(4)}


class Loader:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        return batches(self.n)


def test_batches_come_in_order_from_several_targets():
    extractors = [FakeExtractor(0.0), FakeExtractor(0.0), FakeExtractor(0.0)]
    out = list(FeaturePrefetcher(Loader(10), extractors, torch.device("cpu"), depth=2))
    assert [int(b["input_ids"][0]) for b in out] == list(range(10))
    assert all(torch.equal(b["context_features"][:, 0], b["input_ids"].float()) for b in out)
    assert all(torch.equal(b["final_hidden"][:, 0], b["input_ids"].float()) for b in out)  # every field travels
    assert [e.calls for e in extractors] == [4, 3, 3]  # work is spread round-robin


def test_look_ahead_is_bounded():
    extractor = FakeExtractor(0.0)
    it = iter(FeaturePrefetcher(Loader(50), [extractor], torch.device("cpu"), depth=2))
    next(it)
    threading.Event().wait(0.3)
    assert extractor.calls <= 1 + 2 + 1  # the batch taken, the queue, and one in the producer's hands
    it.close()


def test_errors_in_the_target_thread_are_raised_on_the_trainer_thread():
    class Broken(FakeExtractor):
        def forward(self, input_ids, position_ids):
            raise RuntimeError("target exploded")

    with pytest.raises(RuntimeError, match="target exploded"):
        list(FeaturePrefetcher(Loader(3), [Broken(0.0)], torch.device("cpu"), depth=1))


def test_separate_placement_wraps_only_the_loaders_a_data_module_has(tiny_target):
    """A data module without validation keeps none (wrapping the default would make Lightning call it)."""
    from types import SimpleNamespace

    from lightning.pytorch import LightningDataModule
    from lightning.pytorch.utilities.model_helpers import is_overridden

    from dflash_lightning.target_model import TargetFeatures

    class TrainOnly(LightningDataModule):
        def train_dataloader(self):
            return Loader(3)

    data = TrainOnly()
    trainer = SimpleNamespace(datamodule=data, local_rank=0, num_devices=1,
                              strategy=SimpleNamespace(root_device=torch.device("cpu")))
    TargetFeatures(str(tiny_target), "float32", "separate", ["cpu"], layer_ids=[1]).setup(trainer, object(), "fit")
    assert isinstance(data.train_dataloader(), FeaturePrefetcher)
    assert not is_overridden("val_dataloader", data)
