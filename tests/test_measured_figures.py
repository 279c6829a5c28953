"""No measured figure typed into code: dflash_lightning/ and benchmarks/ read theirs from the results file that
measured them (benchmarks/measured.py), so a rerun moves every figure built on it. The scan below finds what looks
like a typed one, and is tried on planted ones. Figures the docs quote are the measured or collected ones."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
SCANNED = ("dflash_lightning", "benchmarks")
TIMED = re.compile(r"_(S|SECONDS|MS|PER_S|TFLOPS|GBPS|EFFICIENCY)$")
"""Names of a duration, rate or efficiency: a literal of 3 or more significant digits there is a measurement."""


def significant_digits(text: str) -> int:
    """Significant digits of a float literal as written: '0.1507' -> 4, '60.0' -> 1, '1e-6' -> 1, '800e3' -> 1."""
    mantissa = re.split("[eE]", text.replace("_", ""))[0].replace(".", "").lstrip("0")
    return len(mantissa.rstrip("0"))


def measured_constants(source: str, name: str) -> list[str]:
    """'file:line: why' for each float literal of `source` that looks measured: 5 or more significant digits (a
    measurement printed at full precision), 3 or more as a duration or rate constant (`TIMED`), or any other than 0
    on a line whose comment or whose argument's help says "measured"."""
    tree, lines, found = ast.parse(source, name), source.splitlines(), []
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, float)):
            continue
        text = ast.get_source_segment(source, node) or repr(node.value)
        digits, parent = significant_digits(text), parents.get(node)
        if isinstance(parent, ast.UnaryOp):
            parent = parents.get(parent)
        targets = ([t.id for t in parent.targets if isinstance(t, ast.Name)] if isinstance(parent, ast.Assign)
                   else [parent.target.id] if isinstance(parent, ast.AnnAssign) and isinstance(parent.target, ast.Name)
                   else [])
        comment = lines[node.lineno - 1].partition("#")[2]
        call = parents.get(parent) if isinstance(parent, ast.keyword) else None
        helps = [k.value.value for k in getattr(call, "keywords", []) if k.arg == "help"
                 and isinstance(k.value, ast.Constant) and isinstance(k.value.value, str)]
        why = ("a literal of many significant digits" if digits >= 5
               else f"{targets[0]} is a measured kind of figure" if digits >= 3 and any(map(TIMED.search, targets))
               else "said to be measured" if node.value != 0 and "measured" in " ".join([comment, *helps]) else None)
        if why:
            found.append(f"{name}:{node.lineno}: {text}: {why}")
    return found


def test_no_measured_figure_is_typed_into_the_code():
    found = [hit for folder in SCANNED for path in sorted((ROOT / folder).rglob("*.py"))
             for hit in measured_constants(path.read_text(), str(path.relative_to(ROOT)))]
    assert not found, "read these from the results file that measured them (benchmarks/measured.py):\n" + \
        "\n".join(found)


@pytest.mark.parametrize(("source", "why"), [
    ("GPU_STEP_S = 0.15065608919999987\n", "many significant digits"),
    ("PEAK = -795.2008\n", "many significant digits"),
    ("def f(x):\n    return x / 0.1507\n", None),
    ("STEP_S = 0.151\n", "STEP_S is a measured kind of figure"),
    ("SCALING_EFFICIENCY: float = 0.946\n", "SCALING_EFFICIENCY is a measured kind of figure"),
    ("JOIN_S = 60.0\nSYNC_EVERY_S = 1.5\n", None),
    ("p.add_argument('--ddp', type=float, default=0.95, help='measured 2-GPU scaling')\n", "said to be measured"),
    ("p.add_argument('--stall', type=float, default=0.0, help='the stall, measured')\n", None),
    ("FILL = 0.9  # measured on the recipe's data\n", "said to be measured"),
    ("EPS = 1e-6\nBIG = 800e3\nLR = 6e-4\n", None),
])
def test_the_scan_finds_planted_figures_and_passes_settings(source, why):
    found = measured_constants(source, "planted.py")
    assert (found == []) if why is None else (len(found) == 1 and found[0].endswith(why)), found


def test_the_readmes_mfu_is_against_the_cards_dense_peak_with_the_measured_matmul_beside_it():
    """The README's drafter-step MFU divides the step's model TFLOP/s by the card's dense bf16 peak, and the fraction
    of the matmul throughput measured on the card stands beside it, both as step_bench computes them."""
    import json
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from step_bench import DENSE_BF16_TFLOPS, utilisation
    finally:
        sys.path.pop(0)
    (row,) = [line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("| drafter step, ")]
    m = re.search(r"MFU (\d\.\d\d) of the H200's dense bf16 peak \((\d+) TFLOP/s; (\d\.\d\d) of the (\d+) TFLOP/s "
                  r"bf16 matmul measured on it\)", row)
    assert m, row
    result = json.loads((ROOT / "benchmarks/results/h200-2026-11-29.json").read_text())
    step, matmul = result["drafter_step"]["compiled[default]"], result["bf16_matmul_peak_tflops"]
    figures = utilisation(step["tflops"], result["gpu"], matmul)
    assert [m[1], m[3]] == [f"{figures['mfu']:.2f}", f"{figures['matmul_fraction']:.2f}"]
    assert [int(m[2]), int(m[4])] == [round(DENSE_BF16_TFLOPS[result["gpu"]]), round(matmul)]


def test_the_pinned_only_count_the_docs_quote_is_checked_against_the_collected_one():
    """tests/conftest.py compares docs/versions.md's pinned_only count with the collected one whenever the whole suite
    is collected (CI's every part); here, that the comparison refuses another number and a doc without one."""
    from conftest import QUOTED_COUNT, VERSIONS_DOC, check_quoted_count

    text = VERSIONS_DOC.read_text()
    quoted = int(QUOTED_COUNT.search(text)[1])
    check_quoted_count(text, quoted)
    stale = f"says {quoted} tests are pinned_only; the suite collects {quoted + 1}:"
    with pytest.raises(pytest.UsageError, match=stale):
        check_quoted_count(text, quoted + 1)
    with pytest.raises(pytest.UsageError, match="no 'lists the marked tests: N' sentence"):
        check_quoted_count(text.replace("lists the marked", "shows the marked"), quoted)
