"""Old module names of 0.1 (before the package had folders by stage), kept importable for one release with a warning."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

MOVED = {
    "dflash_lightning.target": "dflash_lightning.target_model",
    "dflash_lightning.fingerprints": "dflash_lightning.target_model.fingerprints",
    "dflash_lightning.speculative": "dflash_lightning.decoding.speculative",
    "dflash_lightning.evaluate": "dflash_lightning.decoding.evaluate",
    "dflash_lightning.validation": "dflash_lightning.decoding.validation",
    "dflash_lightning.atomic": "dflash_lightning.long_runs.atomic",
    "dflash_lightning.checkpointing": "dflash_lightning.long_runs.checkpointing",
    "dflash_lightning.preemption": "dflash_lightning.long_runs.preemption",
    "dflash_lightning.resume": "dflash_lightning.long_runs.resume",
    "dflash_lightning.figures": "dflash_lightning.pictures.figures",
    "dflash_lightning.image_logging": "dflash_lightning.pictures.image_logging",
    "dflash_lightning.regenerate_openai": "dflash_lightning.regenerate.openai_backend",
    "dflash_lightning.regenerate_output": "dflash_lightning.regenerate.output",
}


def new_name(name: str) -> str | None:
    """The current name of a moved module (or of a module inside a moved package), None when it did not move."""
    for old, new in MOVED.items():
        if name == old or name.startswith(old + "."):
            return new + name[len(old):]
    return None


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers an old name with the module at its new name: one module object, so classes stay identical."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if (new := new_name(name)) is None:
            return None
        return importlib.machinery.ModuleSpec(name, self, loader_state=new)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(f"{spec.name} moved to {spec.loader_state}; the old name goes in the next release",
                      DeprecationWarning, stacklevel=3)
        module = importlib.import_module(spec.loader_state)
        spec.loader_state = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = module.__spec__.loader_state  # the import system gave the module the alias's spec: undo it


def install() -> None:
    """Put the alias finder first on `sys.meta_path` (first, so the path finder never loads a second copy)."""
    if not any(isinstance(finder, _Alias) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Alias())
