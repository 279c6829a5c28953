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


EXIT_SCRIPT = """
import sys, torch
from types import SimpleNamespace
from lightning.pytorch import LightningDataModule
from dflash_lightning.target_model import TargetFeatures


class Busy(torch.nn.Module):  # a target inside its C++ ops (the GIL released) whenever the interpreter may exit
    device = torch.device("cpu")

    def extract(self, input_ids, position_ids):
        a = torch.randn(400, 400)
        for _ in range(40):
            a = (a @ a).tanh()
        return {"context_features": input_ids.float()[:, None] + a[0, 0]}


class Data(LightningDataModule):
    def train_dataloader(self):
        return [{"input_ids": torch.full((4,), i), "position_ids": torch.arange(4)} for i in range(1000)]


data = Data()
trainer = SimpleNamespace(datamodule=data, strategy=SimpleNamespace(root_device=torch.device("cpu")))
target = TargetFeatures(sys.argv[1], "float32", "separate", ["cpu", "cpu"], layer_ids=[1], prefetch=4)
target.extractors = [Busy(), Busy()]
target.prefetch_loaders(trainer)
batches = iter(data.train_dataloader())
next(batches)  # training stops here (max_steps) with the threads computing ahead
if sys.argv[2] == "teardown":
    target.teardown(trainer, None, "fit")
"""


def test_teardown_joins_the_target_threads_so_the_process_exits_cleanly(tiny_target, tmp_path):
    """Threads still inside the target's ops when the interpreter exits abort it ("terminate called without an active
    exception", exit -6: a DDP fit fed by engines in CI); the callback's teardown stops and joins them first."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "exit.py"
    script.write_text(EXIT_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(script), str(tiny_target), "teardown"], env=env, capture_output=True,
                          text=True, timeout=120)  # with "no-teardown" in its place it aborted 3 times in 3
    assert done.returncode == 0 and "terminate" not in done.stderr, done.stderr[-2000:]


def test_closing_stops_every_live_iteration():
    extractor = FakeExtractor(0.0)
    prefetcher = FeaturePrefetcher(Loader(50), [extractor, FakeExtractor(0.0)], torch.device("cpu"), depth=2)
    it = iter(prefetcher)
    next(it)
    assert prefetcher.halts
    prefetcher.close()
    assert not prefetcher.halts
    assert not [t for t in threading.enumerate() if t.name.startswith("dflash-target")]
    calls = extractor.calls
    threading.Event().wait(0.2)
    assert extractor.calls == calls  # nothing computes after closing
