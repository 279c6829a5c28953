"""Run by the engine venv's python: vLLM 0.34's own model modules, imported into the venv's vLLM 0.32 for the CPU
(no 0.34 build for the CPU exists), from the files tools/vllm_engine_files.sh takes out of the 0.34 wheel into the
venv (VENV/vllm-0.34, tools/engine_venv.sh).

`install()` puts 0.34's DFlash, DFlash2, LiLiCorr, DSpark and XPress model modules in place of 0.32's under
their own names (`vllm.model_executor.models.qwen3_dflash`, ...), before anything imports 0.32's. What 0.34's modules
import and 0.32 lacks, and what takes its place:
 - `refill_derived` (vllm/model_executor/utils.py), `map_draft_quant_config` (vllm/model_executor/models/utils.py),
   `make_attention_sink` (vllm/model_executor/model_loader/weight_utils.py): each function's definition taken from
   0.34's own file and executed in 0.32's module, on whose names it draws (the whole 0.34 module cannot be executed
   beside 0.32's: it registers the same custom ops again);
 - the speculator config classes (`vllm/v1/worker/gpu/spec_decode/<method>/config.py`), which need 0.34's
   speculator-config machinery: the model classes only name them (`speculator_config_class`), so a bare class of
   the same name stands in;
 - the XPress kernels (`spec_decode/xpress/`), Triton: 0.34's own files, run in Triton's interpreter;
 - 0.34's registry entries for XPress folders (`Qwen3XPressModel`, `DFlashQwen3XPressModel`), which 0.32's registry
   lacks: registered through `ModelRegistry.register_model`, vLLM's own way for out-of-tree models.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
import types
from pathlib import Path

MODELS = "vllm/model_executor/models"
SPEC = "vllm/v1/worker/gpu/spec_decode"
# the 0.34 files this takes (tools/vllm_engine_files.sh writes these and only these)
MODULES = ("qwen3_dflash", "qwen3_dflash2", "lilicorr", "qwen3_dspark", "qwen3_xpress")  # in this order (imports)
FILES = tuple(f"{MODELS}/{m}.py" for m in MODULES) + (
    "vllm/model_executor/utils.py", f"{MODELS}/utils.py", "vllm/model_executor/model_loader/weight_utils.py",
    f"{SPEC}/xpress/__init__.py", f"{SPEC}/xpress/kernels.py")
GRAFTS = {"vllm/model_executor/utils.py": ("vllm.model_executor.utils", ["refill_derived"]),
          f"{MODELS}/utils.py": ("vllm.model_executor.models.utils", ["map_draft_quant_config"]),
          "vllm/model_executor/model_loader/weight_utils.py": ("vllm.model_executor.model_loader.weight_utils",
                                                               ["make_attention_sink"])}
SPECULATORS_FILES = ("speculators/models/xpress/model_definitions.py",)  # speculators 0.9.0's XPress refiner
CONFIG_STAND_INS = {"dflash": "DFlashSpeculatorConfig", "dflash2": "DFlash2SpeculatorConfig",
                    "lilicorr": "LiLiCorrSpeculatorConfig", "dspark": "DSparkSpeculatorConfig",
                    "xpress": "XPressSpeculatorConfig"}


def _execute(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def graft(path: Path, module: types.ModuleType, names: list[str]) -> None:
    """The last definition of each function `names` in the file `path`, executed in `module`'s namespace."""
    tree = ast.parse(path.read_text())
    for name in names:
        (*_, node) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
        node.decorator_list = []  # typing.overload stubs come first; the implementation is the last
        exec(compile(ast.Module([node], []), str(path), "exec"), vars(module))


def files() -> Path:
    """Where the engine venv keeps the 0.34 files (this process's venv)."""
    return Path(sys.prefix) / "vllm-0.34"


def install() -> None:
    """0.34's model modules in this process's vLLM, in place of 0.32's; an absent file is an error naming it."""
    if "vllm.model_executor.models.qwen3_xpress" in sys.modules:  # installed already
        return
    folder = files()
    absent = [f for f in FILES + SPECULATORS_FILES if not (folder / f).is_file()]
    if absent:
        raise FileNotFoundError(f"{folder} lacks {', '.join(absent)} (tools/vllm_engine_files.sh)")
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: its kernels then run on CPU tensors
    import triton
    import triton.language
    import vllm.triton_utils as triton_utils

    triton_utils.triton, triton_utils.tl = triton, triton.language  # what 0.34's kernels import: the real Triton
    for path, (target, names) in GRAFTS.items():
        graft(folder / path, importlib.import_module(target), names)
    import vllm.v1.worker.gpu.spec_decode as spec_decode

    spec_decode.__path__.insert(0, str(folder / SPEC))  # 0.34's xpress package (0.32 has none)
    for method, cls in CONFIG_STAND_INS.items():
        name = f"vllm.v1.worker.gpu.spec_decode.{method}.config"
        package = name.rsplit(".", 1)[0]
        if package not in sys.modules and importlib.util.find_spec(package) is None:
            sys.modules[package] = types.ModuleType(package)
            sys.modules[package].__path__ = []
        config = types.ModuleType(name)
        setattr(config, cls, type(cls, (), {}))  # only named by the model class
        sys.modules[name] = config
    for module in MODULES:
        _execute(f"vllm.model_executor.models.{module}", folder / MODELS / f"{module}.py")
    from vllm import ModelRegistry

    # 0.34's registry entries that 0.32 lacks (its registry.py), through vLLM's own out-of-tree registration
    # (the class itself: a name would be inspected in a subprocess, which has 0.32's modules)
    xpress = sys.modules["vllm.model_executor.models.qwen3_xpress"]
    for name in ("Qwen3XPressModel", "DFlashQwen3XPressModel"):  # the second: as the DFlash method renames it
        ModelRegistry.register_model(name, xpress.Qwen3XPressForCausalLM)
