"""The separate placement: copies of the target on their own GPUs compute features ahead in threads.

A node's trainer ranks deal the target devices out among themselves (`rank_devices`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from dflash_lightning.target_model.features import FeatureExtractor


JOIN_S = 60.0  # how long closing waits for a thread inside one batch (an engine request has its own deadline)


class FeaturePrefetcher:
    """Wraps a dataloader: target threads on their own devices (or engines' clients) compute features ahead.

    Batch i+1.. are computed while the drafter trains on batch i, at most `depth` batches ahead per
    device; batches come out in loader order. Only the eager target runs in the threads; every
    compiled drafter call stays on the trainer's thread.
    """

    def __init__(self, loader: Any, extractors: list[FeatureExtractor], out_device: torch.device, depth: int) -> None:
        self.loader, self.extractors, self.out_device, self.depth = loader, extractors, out_device, depth
        self.halts: list[Any] = []  # one per live iteration: stops and joins its threads

    def close(self) -> None:
        """Stops every live iteration's threads and waits for them (teardown: a thread still inside the target's C++
        code when the interpreter exits aborts the process, `terminate called without an active exception`)."""
        for halt in list(self.halts):
            halt()

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
            device = extractor_device(extractor)
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
                    fields = extractor.extract(batch["input_ids"].to(device), batch["position_ids"].to(device))
                    batch.update({name: value.to(self.out_device) for name, value in fields.items()})
                except BaseException as err:
                    batch = err
                outs[rank].put(batch)

        threads = [threading.Thread(target=work, args=(r,), daemon=True, name=f"dflash-target-{r}") for r in range(n)]

        def halt() -> None:
            stop.set()
            with cond:
                cond.notify_all()
            deadline = time.monotonic() + JOIN_S
            for t in threads:
                while t.is_alive() and time.monotonic() < deadline:
                    for q in outs:  # unblock producers waiting on a full queue
                        while not q.empty():
                            q.get_nowait()
                    t.join(timeout=0.05)
            if halt in self.halts:
                self.halts.remove(halt)

        self.halts.append(halt)
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
            halt()


def extractor_device(extractor: Any) -> torch.device:
    """Where an extractor takes its inputs: its own `device` (an engine's client: the CPU), else its weights'."""
    device = getattr(extractor, "device", None)
    return device if isinstance(device, torch.device) else next(extractor.parameters()).device


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
