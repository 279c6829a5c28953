"""The package has no import cycle: every `import` counts, lazy (inside functions) and TYPE_CHECKING ones too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import dflash_lightning

ROOT = Path(dflash_lightning.__file__).parent
PACKAGE = "dflash_lightning"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (`from a import b` names a.b when a.b is a module)."""
    modules = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                while target and target not in modules:  # `import a.b.c` of a function-free path: its module
                    target = target.rpartition(".")[0]
                if target.startswith(PACKAGE) and target != name:
                    graph[name].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_sees_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_graph_sees_lazy_imports():
    graph = import_graph()
    assert "dflash_lightning.commands.cache" in graph["dflash_lightning.commands.cli"]
    assert "dflash_lightning.target_model.sharded" in graph["dflash_lightning.target_model.features"]


def test_no_import_cycle_in_the_package():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_unreleased_old_names_do_not_import():
    """0.1's flat names were never released: no alias keeps them importable."""
    import importlib

    for old in ("dflash_lightning.speculative", "dflash_lightning.target"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(old)


ROOT_MODULES = {"blocks", "config", "errors", "fp8", "loss", "metrics", "model", "module", "module_settings", "opd"}


def test_the_package_root_holds_the_core_only():
    """The root keeps the DFlash core (docs/layout.md names the ten); a module of one stage goes in its folder."""
    found = {p.stem for p in ROOT.glob("*.py")} - {"__init__", "__main__"}
    assert found == ROOT_MODULES, f"added at the root: {sorted(found - ROOT_MODULES)}; docs/layout.md"
