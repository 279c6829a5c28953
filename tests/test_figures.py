"""Pictures: each figure plots the data it is given (read back from its lines, bars and images), and a tiny `fit`
logs its images to TensorBoard."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import yaml
from test_cli import run_config  # noqa: F401 (the module-scoped tiny run config)

from dflash_lightning.blocks import build_block_mask, select_anchors
from dflash_lightning.commands.cli import cli_main
from dflash_lightning.data.packing import collate_documents
from dflash_lightning.pictures.figures import (
    bars_figure,
    batch_figure,
    highlighted_html,
    histogram_figure,
    lines_figure,
    mask_figure,
    report_figure,
    slot_curve_figure,
    step_segments,
)
from dflash_lightning.pictures.image_logging import ImageLogging


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


def lines(ax) -> dict[str, tuple[list[float], list[float]]]:
    """`{label: (x, y)}` of the lines an axis plots."""
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}


def bars(ax) -> dict[str, tuple[list[float], list[float]]]:
    """`{label: (bar centres, heights)}` of the bar series an axis draws."""
    return {c.get_label(): ([b.get_x() + b.get_width() / 2 for b in c], [b.get_height() for b in c])
            for c in ax.containers}


def test_batch_and_mask_figures_show_the_batch_and_the_mask():
    batch = collate_documents([([1] * 30, [False] * 10 + [True] * 20), ([2] * 20, [True] * 20)], 64, 4, 0)
    anchors, valid = select_anchors(batch["loss_mask"], batch["doc_ids"], 6, torch.Generator().manual_seed(0))
    fig = batch_figure(batch, anchors, valid, 4)
    docs, supervised, blocks = (image.get_array().filled(np.nan)[0] for image in fig.axes[0].get_images())
    doc_ids = batch["doc_ids"].numpy()
    np.testing.assert_array_equal(docs, np.where(doc_ids < 0, np.nan, doc_ids))  # padding blank
    np.testing.assert_array_equal(supervised, batch["loss_mask"].numpy())
    covered = np.zeros(64)
    for a in anchors[valid].tolist():
        covered[a : a + 4] = 1
    np.testing.assert_array_equal(blocks, covered)
    (ticks,) = fig.axes[0].collections  # one red line per valid anchor
    assert sorted(seg[0][0] for seg in ticks.get_segments()) == sorted(a + 0.5 for a in anchors[valid].tolist())
    assert "2 documents" in fig.axes[0].get_xlabel() and f"{int(valid.sum())} anchors" in fig.axes[0].get_xlabel()
    full, sliding = build_block_mask(batch["doc_ids"], anchors, valid, 4), torch.rand(24, 88) > 0.5
    fig = mask_figure({"full": full, "sliding": sliding}, 64)
    for ax, (name, mask) in zip(fig.axes, {"full": full, "sliding": sliding}.items(), strict=True):
        assert ax.get_title() == name
        np.testing.assert_array_equal(ax.get_images()[0].get_array(), mask.float().numpy())


def test_curve_histogram_bar_and_line_figures_plot_the_data_given():
    fig = slot_curve_figure({"a": [0.9, 0.5, None], "b": [0.8, 0.4, 0.1]}, ylabel="acceptance", title="slots")
    assert lines(fig.axes[0]) == {"a": ([1, 2], [0.9, 0.5]), "b": ([1, 2, 3], [0.8, 0.4, 0.1])}  # None left out
    assert (fig.axes[0].get_ylabel(), fig.axes[0].get_title()) == ("acceptance", "slots")
    fig = histogram_figure({"a": [3, 2, 1, 0], "b": [0, 0, 1, 1]})  # fractions of the steps, side by side
    assert list(bars(fig.axes[0])) == ["a", "b"]
    (xa, ha), (xb, hb) = bars(fig.axes[0]).values()
    assert ha == pytest.approx([0.5, 1 / 3, 1 / 6, 0]) and hb == [0, 0, 0.5, 0.5]
    assert xa == pytest.approx([-0.2, 0.8, 1.8, 2.8]) and xb == pytest.approx([0.2, 1.2, 2.2, 3.2])
    fig = bars_figure({"one": {"code": 2.0, "chat": 3.0}, "two": {"chat": 1.5, "math": None}}, "tau", "per category")
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["chat", "code", "math"]
    assert {k: h for k, (_, h) in bars(ax).items()} == {"one": [3.0, 2.0, 0.0], "two": [1.5, 0.0, 0.0]}
    assert (ax.get_ylabel(), ax.get_title()) == ("tau", "per category")
    fig = lines_figure({"train": ([0, 4, 8], [3.0, 2.0, 1.5]), "val": ([8], [1.8])}, "step", "loss")
    assert lines(fig.axes[0]) == {"train": ([0, 4, 8], [3.0, 2.0, 1.5]), "val": ([8], [1.8])}
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["train", "val"]


def test_report_figure_plots_each_temperature_run():
    runs = [{"temperature": 0.0, "acceptance_histogram": [1, 1, 2], "slot_acceptance": [0.75, 0.5],
             "tau_pooled": 2.25, "tau_prompt_mean": 2.5, "expected_tau_pooled": 2.25, "speedup": 1.5},
            {"temperature": 0.6, "acceptance_histogram": [3, 1, 0], "slot_acceptance": [0.25, 0.0],
             "tau_pooled": 1.25, "tau_prompt_mean": 1.3, "expected_tau_pooled": 1.4, "speedup": 1.1}]
    fig = report_figure(runs)
    histograms, slots = fig.axes
    assert {k: h for k, (_, h) in bars(histograms).items()} == {"temperature 0": [0.25, 0.25, 0.5],
                                                                 "temperature 0.6": [0.75, 0.25, 0.0]}
    assert lines(slots) == {"temperature 0": ([1, 2], [0.75, 0.5]), "temperature 0.6": ([1, 2], [0.25, 0.0])}
    assert fig.get_suptitle().splitlines() == [
        "T 0: tau 2.25 pooled, 2.50 prompt mean, 2.25 expected; 1.50x",
        "T 0.6: tau 1.25 pooled, 1.30 prompt mean, 1.40 expected; 1.10x"]


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
