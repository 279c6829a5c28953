"""What refactoring must not change: every preset's exported folder, byte for byte, and a checkpoint written by an
older tree still resumes and exports.

The folders are written from weights set by a formula (no random generator), so their digests hold on every
version set; `python tests/test_folder_digests.py` rewrites tests/data/folder_digests.json after a deliberate change
of the format (say why in the commit).
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).parents[1]
DIGESTS = ROOT / "tests" / "data" / "folder_digests.json"
LEGACY = ROOT / "tests" / "data" / "legacy"
LEGACY_CKPT = LEGACY / "dflash2-e822d71.ckpt"  # 2 steps of LEGACY/fit.yaml (the tiny default, smaller) at e822d71
TINY_TARGET = ROOT / "dflash_lightning" / "assets" / "tiny" / "target_model"
DTYPES = ("float32", "bfloat16")


def formula_state(names_shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """Weights from their names and shapes only: 0.1 sin(0.37 i + k) over each tensor's flat index i, k its rank
    in name order."""
    state = {}
    for k, name in enumerate(sorted(names_shapes)):
        shape = names_shapes[name]
        n = math.prod(shape)
        state[name] = (0.1 * torch.sin(torch.arange(n, dtype=torch.float64) * 0.37 + k)).float().reshape(shape)
    return state


def folder_digests(folder: Path) -> dict[str, str]:
    """sha256 of every file of a folder, by name."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def preset_folders(out: Path) -> dict[str, dict[str, str]]:
    """Every preset's folder for the tiny default target, in each dtype: their files' digests by `variant/dtype`."""
    from test_contract import tiny_config

    from dflash_lightning.folder.writer import write_folder
    from dflash_lightning.model import DFlashDrafter
    from dflash_lightning.parts.presets import PRESETS
    from dflash_lightning.target_model import load_target_config, tokenizer_ids

    made = {}
    for variant in PRESETS:
        cfg = tiny_config(variant).resolved(load_target_config(str(TINY_TARGET)), *tokenizer_ids(str(TINY_TARGET)))
        shapes = {k: v.shape for k, v in DFlashDrafter(cfg).state_dict().items()}
        state = formula_state(shapes)
        for dtype in DTYPES:
            made[f"{variant}/{dtype}"] = folder_digests(write_folder(cfg, state, out / variant / dtype, dtype))
    return made


def test_every_preset_folder_is_byte_identical_to_the_recorded_one(tmp_path):
    """config.json, the modelling file and the weights of every preset's folder, in float32 and bfloat16, hash to
    what tests/data/folder_digests.json records."""
    recorded = json.loads(DIGESTS.read_text())
    made = preset_folders(tmp_path)
    assert sorted(made) == sorted(recorded), "a preset was added or removed: rewrite the digests (module docstring)"
    changed = [f"{key}/{name}" for key in made for name in made[key] | recorded[key]
               if made[key].get(name) != recorded[key].get(name)]
    assert not changed, f"files that differ from the recorded folders: {changed}"


def test_a_checkpoint_written_by_an_older_tree_resumes_and_exports(tmp_path, monkeypatch):
    """tests/data/legacy's checkpoint (written at e822d71) exports to the folder it exported then, and resumes for a
    third step with its settings accepted."""
    from dflash_lightning.commands.cli import cli_main
    from dflash_lightning.folder.writer import export_checkpoint
    from dflash_lightning.long_runs.checkpointing import load_checkpoint

    recorded = json.loads((LEGACY / "export_digests.json").read_text())
    assert folder_digests(export_checkpoint(LEGACY_CKPT, tmp_path / "folder")) == recorded
    monkeypatch.chdir(ROOT)  # the config names the tiny default's files relative to the repository
    config = yaml.safe_load((LEGACY / "fit.yaml").read_text())
    run = tmp_path / "run"
    config["trainer"].update(default_root_dir=str(run), max_steps=3)
    config["trainer"]["callbacks"][0]["init_args"]["dirpath"] = str(run / "checkpoints")
    (tmp_path / "fit.yaml").write_text(yaml.safe_dump(config))
    cli_main(["fit", "--config", str(tmp_path / "fit.yaml"), f"--ckpt_path={LEGACY_CKPT}"])
    assert load_checkpoint(run / "checkpoints" / "last.ckpt", mmap=True, verify=False)["global_step"] == 3


if __name__ == "__main__":  # rewrite the recorded digests (after a deliberate change of the folder format)
    import tempfile

    sys.path.insert(0, str(Path(__file__).parent))
    from dflash_lightning.folder.writer import export_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        DIGESTS.write_text(json.dumps(preset_folders(Path(tmp)), indent=1, sort_keys=True) + "\n")
        legacy = folder_digests(export_checkpoint(LEGACY_CKPT, Path(tmp) / "legacy"))
        (LEGACY / "export_digests.json").write_text(json.dumps(legacy, indent=1, sort_keys=True) + "\n")
    print(f"wrote {DIGESTS} and {LEGACY / 'export_digests.json'}")
