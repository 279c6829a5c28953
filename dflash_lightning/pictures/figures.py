"""Pictures of what the drafter does: a packed batch, block masks, per-slot curves, acceptance, decoded text.

Plain matplotlib figures (and one HTML string) built from the tensors and reports the project already makes;
the notebooks and the `ImageLogging` callback draw with these, so a picture means the same everywhere.
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from dflash_lightning.decoding.speculative import counted_tokens

# One colour per decode step in highlighted text (cycled), light enough to read black text on.
STEP_COLOURS = ("#ffd6a5", "#caffbf", "#9bf6ff", "#bdb2ff", "#ffc6ff", "#fdffb6", "#a0c4ff", "#ffadad")


def _figure(width: float, height: float, ncols: int = 1):
    """A figure outside pyplot's global state: nothing to close, no window, safe in a training process."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig, list(fig.subplots(1, ncols, squeeze=False)[0])


def _finish(fig, ax, xlabel: str, ylabel: str, title: str, legend: bool, grid: bool = False):
    """Labels, optional title, legend and grid, then a tight layout: the last lines of every figure here."""
    if xlabel:
        ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if grid:
        ax.grid(alpha=0.3)
    if title:
        ax.set_title(title)
    if legend:
        ax.legend()
    fig.tight_layout()
    return fig


def batch_figure(batch: Mapping[str, Tensor], anchors: Tensor, valid: Tensor, block_size: int):
    """One packed row as strips: documents (colour), padding (white), supervised tokens, anchors and blocks."""
    doc_ids, loss_mask = batch["doc_ids"].cpu(), batch["loss_mask"].cpu()
    t = doc_ids.numel()
    fig, (ax,) = _figure(12, 2.6)
    docs = doc_ids.float().masked_fill(doc_ids < 0, float("nan"))[None]  # [1, T]
    ax.imshow(docs, aspect="auto", cmap="tab20", interpolation="nearest", extent=(0, t, 2, 3))
    ax.imshow(loss_mask.float()[None], aspect="auto", cmap="Greys", vmin=0, vmax=1.5, interpolation="nearest",
              extent=(0, t, 1, 2))
    covered = torch.zeros(t)
    for a in anchors[valid].cpu().tolist():
        covered[a : a + block_size] = 1
    ax.imshow(covered[None], aspect="auto", cmap="Blues", vmin=0, vmax=1.5, interpolation="nearest",
              extent=(0, t, 0, 1))
    ax.vlines(anchors[valid].cpu().numpy() + 0.5, 0, 1, colors="crimson", linewidth=0.6)
    ax.set_ylim(0, 3)
    ax.set_yticks([0.5, 1.5, 2.5], ["blocks (anchor red)", "supervised", "documents"])
    n_docs = int(doc_ids.max()) + 1 if (doc_ids >= 0).any() else 0
    ax.set_xlabel(f"token position ({t} tokens, {n_docs} documents, {int((doc_ids < 0).sum())} padding, "
                  f"{int(valid.sum())} anchors of {valid.numel()})")
    fig.tight_layout()
    return fig


def mask_figure(masks: Mapping[str, Tensor], context_tokens: int):
    """Dense block masks `[A*B, T + A*B]` side by side (e.g. a full and a sliding-window layer)."""
    fig, axes = _figure(6 * len(masks), 3.6, len(masks))
    for ax, (name, mask) in zip(axes, masks.items(), strict=True):
        ax.imshow(mask.float().cpu(), aspect="auto", interpolation="nearest", cmap="Greys")
        ax.axvline(context_tokens - 0.5, color="crimson", linewidth=0.8)
        ax.set_title(name)
        ax.set_xlabel(f"keys: context (0..{context_tokens - 1}) | block tokens")
        ax.set_ylabel("block queries (anchor x slot)")
    fig.tight_layout()
    return fig


def _slot_curves_on(ax, curves: Mapping[str, Sequence[float | None]]) -> None:
    for name, values in curves.items():
        slots = [k for k, v in enumerate(values, start=1) if v is not None]
        ax.plot(slots, [values[k - 1] for k in slots], marker="o", markersize=3, label=name)
    ax.set_ylim(0, 1)


def _histograms_on(ax, histograms: Mapping[str, Sequence[int]]) -> None:
    width = 0.8 / max(1, len(histograms))
    for i, (name, counts) in enumerate(histograms.items()):
        total = max(1, sum(counts))
        xs = [k + (i - (len(histograms) - 1) / 2) * width for k in range(len(counts))]
        ax.bar(xs, [c / total for c in counts], width=width, label=name)


ACCEPTED = "draft tokens accepted in a step (tau of the step - 1)"


def slot_curve_figure(curves: Mapping[str, Sequence[float | None]], ylabel: str = "accuracy", title: str = ""):
    """Per-slot curves (slot 1..B-1 on x), one line per name: accuracy at training, acceptance when served."""
    fig, (ax,) = _figure(6, 3.6)
    _slot_curves_on(ax, curves)
    return _finish(fig, ax, "slot k", ylabel, title, len(curves) > 1, grid=True)


def histogram_figure(histograms: Mapping[str, Sequence[int]], title: str = ""):
    """Acceptance-length histograms (accepted draft tokens per step, 0..B-1) as fractions of the steps."""
    fig, (ax,) = _figure(6, 3.6)
    _histograms_on(ax, histograms)
    return _finish(fig, ax, ACCEPTED, "fraction of steps", title, len(histograms) > 1)


def report_figure(runs: Sequence[Mapping[str, Any]]):
    """`evaluate`'s report.png: the acceptance histogram and per-slot P(accepted >= k), one series per temperature,
    the run's tau figures above."""
    fig, (left, right) = _figure(12, 4.5, ncols=2)
    names = [f"temperature {run['temperature']:g}" for run in runs]
    _histograms_on(left, {n: run["acceptance_histogram"] for n, run in zip(names, runs, strict=True)})
    _slot_curves_on(right, {n: run["slot_acceptance"] for n, run in zip(names, runs, strict=True)})
    titles = [f"T {run['temperature']:g}: tau {run['tau_pooled']:.2f} pooled, {run['tau_prompt_mean']:.2f} prompt "
              f"mean, {run['expected_tau_pooled']:.2f} expected; {run['speedup']:.2f}x"
              if run["tau_pooled"] and run["speedup"] else f"T {run['temperature']:g}: no decode steps" for run in runs]
    fig.suptitle("\n".join(titles), fontsize=10)
    _finish(fig, left, ACCEPTED, "fraction of steps", "acceptance lengths", True)
    return _finish(fig, right, "slot k", "P(accepted >= k)", "per-slot acceptance", True, grid=True)


def bars_figure(values: Mapping[str, Mapping[str, float | None]], ylabel: str, title: str = ""):
    """Grouped bars: `values[series][group]` (e.g. tau per category per drafter, or per temperature)."""
    groups = sorted({g for series in values.values() for g in series}, key=str)
    fig, (ax,) = _figure(max(6, 0.8 * len(groups) * max(1, len(values))), 3.6)
    width = 0.8 / max(1, len(values))
    for i, (name, series) in enumerate(values.items()):
        xs = [g + (i - (len(values) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, [series.get(g) or 0.0 for g in groups], width=width, label=name)
    ax.set_xticks(range(len(groups)), [str(g) for g in groups])
    return _finish(fig, ax, "", ylabel, title, len(values) > 1)


def lines_figure(series: Mapping[str, tuple[Sequence[float], Sequence[float]]], xlabel: str, ylabel: str,
                 title: str = ""):
    """Named (x, y) lines on one axis: loss or tau against the step."""
    fig, (ax,) = _figure(6, 3.6)
    for name, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=name)
    return _finish(fig, ax, xlabel, ylabel, title, True, grid=True)


def step_segments(tokens: Sequence[int], accepted_lengths: Sequence[int]) -> list[list[int]]:
    """The generated tokens cut by the step that emitted them: the prefill's token, then what each step counts
    (a + 1, the last step only up to the kept output: `speculative.counted_tokens`)."""
    segments, start = [list(tokens[:1])], 1
    for n in counted_tokens([a + 1 for a in accepted_lengths], len(tokens) - 1):
        if n:
            segments.append(list(tokens[start : start + n]))
        start += n
    return segments


def highlighted_html(tokenizer: Any, tokens: Sequence[int], accepted_lengths: Sequence[int]) -> str:
    """HTML of a speculative generation: each step's tokens on their own colour, the step's tau on hover."""
    parts = []
    for i, segment in enumerate(step_segments(tokens, accepted_lengths)):
        text = html.escape(tokenizer.decode(segment)).replace("\n", "&#9166;<br>")
        what = "prefill" if i == 0 else f"step {i}: tau {len(segment)}"
        parts.append(f'<span title="{what}" style="background:{STEP_COLOURS[i % len(STEP_COLOURS)]}">{text}</span>')
    return '<div style="font-family:monospace;line-height:1.6">' + "".join(parts) + "</div>"


def figure_to_array(fig) -> Any:
    """RGB pixels `[H, W, 3]` uint8 of a figure (what image loggers without matplotlib support take)."""
    import numpy as np

    fig.canvas.draw()
    return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()


__all__ = [
    "bars_figure", "batch_figure", "figure_to_array", "highlighted_html", "histogram_figure", "lines_figure",
    "mask_figure", "slot_curve_figure", "step_segments",
]
