"""Pictures: the figures draw from real batches and reports, and a tiny `fit` logs its images to TensorBoard."""

from __future__ import annotations

import torch
import yaml
from test_cli import run_config  # noqa: F401 (the module-scoped tiny run config)

from dflash_lightning.blocks import build_block_mask, select_anchors
from dflash_lightning.cli import cli_main
from dflash_lightning.data.packing import collate_documents
from dflash_lightning.figures import (
    batch_figure,
    highlighted_html,
    histogram_figure,
    mask_figure,
    slot_curve_figure,
    step_segments,
)
from dflash_lightning.image_logging import ImageLogging


def test_step_segments_cut_the_tokens_as_the_decoder_emitted_them():
    tokens = list(range(10))
    assert step_segments(tokens, [2, 0, 3]) == [[0], [1, 2, 3], [4], [5, 6, 7, 8]]
    assert step_segments(tokens[:3], [4]) == [[0], [1, 2]]  # the last step cut by the length limit


class Words:
    def decode(self, ids):
        return " ".join(f"t{i}" for i in ids) + " "


def test_highlighted_html_gives_each_step_its_own_span():
    html = highlighted_html(Words(), [5, 6, 7, 8], [1, 0])
    assert html.count("<span") == 3
    assert 'title="step 1: tau 2"' in html and "t6 t7" in html


def test_figures_draw_a_real_batch_and_report():
    batch = collate_documents([([1] * 30, [False] * 10 + [True] * 20), ([2] * 20, [True] * 20)], 64, 4, 0)
    anchors, valid = select_anchors(batch["loss_mask"], batch["doc_ids"], 6, torch.Generator().manual_seed(0))
    mask = build_block_mask(batch["doc_ids"], anchors, valid, 4)
    for fig in (batch_figure(batch, anchors, valid, 4), mask_figure({"full": mask}, 64),
                slot_curve_figure({"a": [0.9, 0.5, None]}), histogram_figure({"a": [3, 2, 1, 0]})):
        fig.canvas.draw()
        assert len(fig.axes) >= 1


def test_fit_logs_slot_accuracy_and_served_histogram_images(run_config):  # noqa: F811
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root = run_config.parent / "runs-images"
    config = yaml.safe_load(run_config.read_text())
    config["trainer"].update(default_root_dir=str(root), logger=[
        {"class_path": "lightning.pytorch.loggers.TensorBoardLogger", "init_args": {"save_dir": str(root)}}])
    config["trainer"]["callbacks"] = []
    config["spec_eval"].update(prompts=str(run_config.parent / "val.jsonl"), every_n_steps=2, num_prompts=1,
                               max_new_tokens=8)
    path = root / "config.yaml"
    root.mkdir()
    path.write_text(yaml.safe_dump(config))
    cli = cli_main(["fit", "--config", str(path)])
    images = next(c for c in cli.trainer.callbacks if isinstance(c, ImageLogging)).logged
    assert ("val/slot_accuracy", 2) in images and ("val/acceptance_histogram", 2) in images
    events = EventAccumulator(str(next(root.rglob("events.out.tfevents.*")).parent), size_guidance={"images": 0})
    events.Reload()
    assert {"val/slot_accuracy", "val/acceptance_histogram"} <= set(events.Tags()["images"])
    assert [e.step for e in events.Images("val/slot_accuracy")] == [2, 4]
