"""DraftMetrics against values computed by hand on small, fully specified predictions."""

from __future__ import annotations

import torch

from dflash_lightning.metrics import DraftMetrics


def test_per_slot_accuracy_topk_and_acceptance_by_hand():
    # 3 blocks of 4 slots; slot 0 never counts (weight 0). Labels are 10 + slot index.
    labels = torch.tensor([[0, 11, 12, 13]] * 3)
    weights = torch.tensor([[0, 1.0, 0.5, 0.25], [0, 1.0, 0.5, 0.0], [0, 1.0, 0.5, 0.25]])
    # top-2 ids per slot, best first.
    top = torch.tensor([
        [[0, 0], [11, 5], [12, 5], [7, 13]],    # slots 1, 2 right at top-1; slot 3 only in top-2 -> accepted 2
        [[0, 0], [11, 5], [5, 12], [13, 5]],    # slot 1 right; slot 2 in top-2; slot 3 unsupervised -> accepted 1
        [[0, 0], [5, 11], [12, 5], [13, 5]],    # slot 1 wrong at top-1 -> accepted 0 though 2 and 3 are right
    ])
    metric = DraftMetrics(block_size=4, topk=(1, 2))
    metric.update(top, labels, weights)
    out = metric.compute()
    # slot 1: 2 of 3 right; slot 2: 2 of 3; slot 3: 1 of 2 supervised (block 2 slot 3 is unsupervised).
    torch.testing.assert_close(out["acc/slot_01"], torch.tensor(2 / 3))
    torch.testing.assert_close(out["acc/slot_02"], torch.tensor(2 / 3))
    torch.testing.assert_close(out["acc/slot_03"], torch.tensor(1 / 2))
    torch.testing.assert_close(out["acc"], torch.tensor((2 / 3 + 2 / 3 + 1 / 2) / 3))
    torch.testing.assert_close(out["top2/slot_01"], torch.tensor(1.0))
    torch.testing.assert_close(out["top2/slot_03"], torch.tensor(1.0))
    torch.testing.assert_close(out["tau"], torch.tensor(1 + (2 + 1 + 0) / 3))
    torch.testing.assert_close(out["tau_coarse"], torch.tensor(1 + 2 / 3 + 4 / 9 + 2 / 9))


def test_accumulates_over_updates_and_resets():
    metric = DraftMetrics(block_size=2, topk=(1,))
    labels, weights = torch.tensor([[0, 1]]), torch.tensor([[0.0, 1.0]])
    metric.update(torch.tensor([[[0], [1]]]), labels, weights)
    metric.update(torch.tensor([[[0], [2]]]), labels, weights)
    assert metric.compute()["acc"] == 0.5 and metric.compute()["tau"] == 1.5
    metric.reset()
    metric.update(torch.tensor([[[0], [1]]]), labels, weights)
    assert metric.compute()["acc"] == 1.0


def test_invalid_blocks_do_not_count():
    metric = DraftMetrics(block_size=3, topk=(1,))
    labels = torch.tensor([[0, 1, 2], [0, 1, 2]])
    weights = torch.tensor([[0, 1.0, 1.0], [0, 0.0, 0.0]])  # second anchor slot unused
    metric.update(torch.tensor([[[0], [1], [2]], [[0], [9], [9]]]), labels, weights)
    assert metric.compute()["tau"] == 3.0
