"""The repository's tools stay runnable from a checkout, and outside the package the wheel ships."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import dflash_lightning

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.pinned_only("tool")
def test_build_tiny_runs_from_the_repository_and_writes_into_the_package_assets():
    """`python tools/build_tiny.py --help` works from any folder and defaults to the package's tiny assets."""
    out = subprocess.run([sys.executable, str(REPO / "tools" / "build_tiny.py"), "--help"], cwd="/",
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--minutes" in out.stdout
    assert str(Path("dflash_lightning") / "assets" / "tiny") in " ".join(out.stdout.split())


def test_the_package_holds_the_tiny_assets_but_not_the_script_that_made_them():
    """The wheel ships `dflash_lightning/` (pyproject's package-data: assets/**/*); the builder lives in tools/."""
    assets = Path(dflash_lightning.__file__).parent / "assets"
    assert (assets / "tiny" / "target_model" / "model.safetensors").is_file()
    assert sorted(p.name for p in assets.rglob("*.py")) == ["__init__.py"]
