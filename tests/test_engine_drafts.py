"""The engines' own model code on our exported folders of every variant they serve, a trained one and a random one
of each: z-lab's `dflash` 0.1.0, SGLang 0.5.23 and vLLM 0.34 build the drafter from the folder's config.json, load its
weights with no missing or unexpected one, and on a real context of the tiny target give `evaluate`'s block hidden
states and logits (within TOLERANCE) and its greedy drafts (equal), each variant drafted by the engine's own rule for
it (DSpark's confidences too, within TOLERANCE). The engines run in the engine venv (tests/dflash_engines.py); skipped,
naming what is missing, unless $DFLASH_ENGINE_PYTHON names it (.ci/run's engine part sets it, and there a missing
engine, module or file fails)."""

from __future__ import annotations

import importlib
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import tiny_fit_config

from dflash_lightning.commands.export import export
from dflash_lightning.config import DrafterConfig
from dflash_lightning.decoding.evaluate import prompt_ids, read_prompts
from dflash_lightning.decoding.speculative import DraftContext, SpeculativeDecoder
from dflash_lightning.folder.reader import load_drafter
from dflash_lightning.folder.serve import serve_commands
from dflash_lightning.folder.writer import write_folder
from dflash_lightning.model import DFlashDrafter
from dflash_lightning.parts.convolutions import ConvSettings
from dflash_lightning.parts.domino import FOLDER_DTYPE, SGLANG_POOL
from dflash_lightning.parts.lilicorr import LiLiCorrSettings
from dflash_lightning.parts.selector import SelectorSettings

ROOT = Path(__file__).parents[1]
TARGET = ROOT / "dflash_lightning" / "assets" / "tiny" / "target_model"
PROMPTS = ROOT / "dflash_lightning" / "assets" / "tiny" / "data" / "prompts.jsonl"
ENGINE = os.environ.get("DFLASH_ENGINE_PYTHON", "")
FIT_STEPS = 10  # a short fit: weights that training moved, not an initialisation
# The variants whose folders each engine's own model class loads and drafts (Domino: SGLang alone, XPress: vLLM alone)
ENGINES = {"dflash": ("dflash", "dflash2"),
           "sglang": ("dflash", "dflash2", "lilicorr", "lilicorr-conv", "dspark", "domino"),
           "vllm": ("dflash", "dflash2", "lilicorr", "lilicorr-conv", "dspark", "xpress")}
# LiLiCorr's lattice for both folders: its default is sized for 8B drafters (10 steps of it on the tiny target take
# minutes, and it slows every engine case of a random folder)
SMALL_LATTICE = LiLiCorrSettings(hidden_size=0, factor_dim=128)
# the settings a variant's fit needs beyond the tiny config (benchmarks/objective_ab.py's recipes)
TINY_LATTICE = [f"--model.drafter.lilicorr.{name}={getattr(SMALL_LATTICE, name)}" for name in ("hidden_size",
                                                                                                 "factor_dim")]
CE = ["--model.objective=ce", "--model.loss_weights=decay"]
FIT_SETTINGS = {"dspark": CE, "lilicorr": TINY_LATTICE, "lilicorr-conv": TINY_LATTICE, "xpress": CE, "domino": CE}
# a random folder's settings beyond the defaults
SMALL = {"dflash2": {"conv": ConvSettings(3, 16), "selector": SelectorSettings(8, 4)},
         "lilicorr": {"lilicorr": SMALL_LATTICE}, "lilicorr-conv": {"lilicorr": SMALL_LATTICE}}
# The drafting part's weights of a random folder move by this much (std): at 0.1, as the backbone's, XPress's refiner
# reaches its Jacobi fixed point in one pass, so a wrong pass count would draft the same tokens
RULE_NOISE = 0.5
# A folder's dtype: fp32 (the engines cast weights to the served dtype), but Domino's, which `export` writes in bf16
# only (the weights its engine takes; both sides then compute in fp32 on those values)
DTYPES = {"domino": FOLDER_DTYPE}
# fp32 on both sides; the engines' paths differ from ours by summation order (SDPA against our masked attention,
# fused q/k/v and gate/up projections), observed below 1e-5 on logits of magnitude ~10
TOLERANCE = dict(rtol=1e-4, atol=1e-4)
# What the CPU cannot run in each engine and what replaces it (tests/dflash_engines.py)
STAND_INS = {
    "dflash": [],  # plain torch and transformers
    "sglang": ["RadixAttention -> torch SDPA over the context K/V SGLang's worker writes and the block's own",
               "sgl_kernel (compiled kernels, no CPU wheel) -> an import stand-in none of these paths calls",
               "torchvision (multimodal helpers) -> an import stand-in",
               "the TP group's all_gather (DSpark's base logits; SGLang's one-rank test topology has no collectives) "
               "-> the identity"],
    "vllm": ["Attention -> torch SDPA over the context K/V vLLM's precompute_and_store_context_kv writes and the "
             "block's own",
             "ops.rms_norm with a weight per layer (0.34's context-K norm; 0.32's CPU kernel takes the first layer's "
             "weight for all) -> the same norm in torch",
             "the DFlash2 and LiLiCorr walk (the speculator's Triton kernel) -> its greedy rule in torch, on the "
             "scores of vLLM's own CandidateSelector / LiLiCorr head",
             "the Model Runner V2 speculators (0.34's spec_decode/<method>/speculator.py, which need 0.34's GPU "
             "runner) -> their greedy steps restated over the model's own methods: LiLiCorr's anchor "
             "(prepare_context_anchor) and _score_candidates, DSpark's _sample_markov_chain, XPress's _jacobi_refine "
             "(its Triton kernels themselves run, interpreted)"],
}
# The parts whose heads alone each engine also runs on given inputs (tests/test_<part>.py: `engine_cases`, built with
# its own helpers, and `check_engine`): LiLiCorr's scores and walks, sampled too; DSpark's Markov term and confidence,
# a calibrated folder's too; XPress's refined logits, top-C drafts and speculators' refiner
HEADS = {"lilicorr": ("vllm", "sglang"), "dspark": ("vllm",), "xpress": ("vllm",)}
assert STAND_INS.keys() == ENGINES.keys()
pytestmark = pytest.mark.skipif(not ENGINE, reason="no engine venv: $DFLASH_ENGINE_PYTHON is not set "
                                                   "(tools/engine_venv.sh; .ci/run's engine part sets it)")


def project_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def start_fit(variant: str, work: Path) -> subprocess.Popen:
    """`fit` of the tiny config for FIT_STEPS steps, as a user runs it, started (the two variants' fits run at once)."""
    config = tiny_fit_config(work, FIT_STEPS)
    return subprocess.Popen([sys.executable, "-m", "dflash_lightning", "fit", "--config", str(config),
                             f"--model.drafter.variant={variant}", *FIT_SETTINGS.get(variant, [])], cwd=ROOT,
                            env=project_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def random_folder(variant: str, work: Path) -> Path:
    """A drafter as initialised, every weight moved off its initial value (norms not 1, convolutions not the
    identity) and the drafting part's by more (RULE_NOISE), written as `export` writes it."""
    from transformers import AutoConfig

    cfg = DrafterConfig(num_layers=2, block_size=8, mask_token_id=4000, variant=variant, **SMALL.get(variant, {}))
    cfg = cfg.resolved(AutoConfig.from_pretrained(TARGET))
    torch.manual_seed(1)
    drafter = DFlashDrafter(cfg)
    rule = next((part for part in drafter.parts if part.decodes), None)
    ruled = {id(p) for p in (rule.parameters() if rule is not None else [])}
    for p in drafter.parameters():
        p.data += (RULE_NOISE if id(p) in ruled else 0.1) * torch.randn_like(p)
    return write_folder(cfg, drafter.state_dict(), work / "drafter", DTYPES.get(variant, "float32"))


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[tuple[str, str], Path]:
    """A trained (`fit`, then `export`, DTYPES) and a random folder of each variant; the fits run two at a time."""
    variants = sorted({v for vs in ENGINES.values() for v in vs})
    made = {}
    for pair in (variants[i : i + 2] for i in range(0, len(variants), 2)):
        works = {variant: tmp_path_factory.mktemp(f"{variant}-trained") for variant in pair}
        fits = {variant: start_fit(variant, work) for variant, work in works.items()}
        try:
            for variant in pair:
                made[variant, "random"] = random_folder(variant, tmp_path_factory.mktemp(f"{variant}-random"))
            for variant, fit in fits.items():
                _, stderr = fit.communicate(timeout=900)
                assert fit.returncode == 0, f"fit of {variant} failed:\n{stderr[-3000:]}"
                made[variant, "trained"] = export(checkpoint=str(works[variant] / "run/checkpoints/last.ckpt"),
                                                  out=str(works[variant] / "drafter"),
                                                  dtype=DTYPES.get(variant, "float32"))
        finally:
            for fit in fits.values():
                if fit.poll() is None:
                    fit.kill()
                    fit.wait()
    return made


@pytest.fixture(scope="module")
def cases(folders) -> dict[tuple[str, str], tuple[dict, dict]]:
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    return {key: case_of(folder, target) for key, folder in folders.items()}


def case_of(folder: Path, target: torch.nn.Module) -> tuple[dict, dict]:
    """Inputs of one block after a real prompt of the tiny target, and `evaluate`'s side on them: the drafter it
    loads from the folder, its context, block hidden states, logits and (DFlash, DFlash2) drafts
    (SpeculativeDecoder.draft, DSpark's confidences); the vLLM speculative config and the SGLang Domino candidate
    pool of the commands `export` prints for the folder."""
    from transformers import AutoTokenizer, DynamicCache

    drafter = load_drafter(folder, str(TARGET))
    decoder = SpeculativeDecoder(target, drafter)
    prompt = torch.tensor(prompt_ids(AutoTokenizer.from_pretrained(TARGET), read_prompts(PROMPTS)[0]))
    with torch.no_grad():
        logits, features = decoder._target(prompt, DynamicCache())
    x = logits[-1].argmax()
    n, b = prompt.numel(), drafter.config.block_size
    context = DraftContext(drafter)
    context.extend(features, torch.arange(n))
    block = torch.full((b,), drafter.config.mask_token_id)
    block[0] = x
    with torch.no_grad():
        hidden = context.block_hidden(block, n)
        drafted = decoder.draft(context, x, n)
    ours = {"hidden": hidden, "logits": drafter.logits(hidden), "drafts": drafted.tokens,
            "confidence": drafted.extras.get("confidence")}
    inputs = {"features": features, "block": block, "embed": drafter.embed_weight, "head": drafter.head_weight}
    commands = {k: shlex.split(v) for k, v in serve_commands(folder, drafter.config, str(TARGET)).items()}
    spec = json.loads(flag(commands["vllm"], "--speculative-config")) if "vllm" in commands else None
    pool = flag(commands.get("sglang", []), "--speculative-domino-candidate-pool-size")
    return {"folder": str(folder), "target": str(TARGET), "vllm_spec": spec, "inputs": inputs,
            "sglang_pool": SGLANG_POOL if pool is None else int(pool)}, ours


def flag(command: list[str], name: str) -> str | None:
    """The value of `name` in a printed serve command (split), None where it is absent."""
    return command[command.index(name) + 1] if name in command else None


@pytest.fixture(scope="module")
def engine_runs(cases, tmp_path_factory) -> dict[str, dict]:
    """Each engine run once (one process: its import is the slow part) on its folders' cases, then on the heads'
    cases (HEADS); by engine, {"folders": what it gave for each folder, in the order of `cases`, "heads": (part,
    case, ours, what it gave) of each head case}."""
    runs = {}
    for engine, variants in ENGINES.items():
        work = tmp_path_factory.mktemp(f"{engine}-run")
        folders = [case for key, (case, _) in cases.items() if key[0] in variants]
        heads = head_cases(engine, work)
        torch.save(folders + [{**case, "head": head} for head, case, _ in heads], work / "in.pt")
        done = subprocess.run([ENGINE, str(Path(__file__).with_name("dflash_engines.py")), str(work / "in.pt"),
                               str(work / "out.pt"), engine], capture_output=True, text=True, timeout=900,
                              cwd=Path(__file__).parent)
        assert done.returncode == 0, f"{engine}: {done.stderr[-3000:]}"
        outs = torch.load(work / "out.pt")
        runs[engine] = {"folders": outs[: len(folders)],
                        "heads": [(*head, out) for head, out in zip(heads, outs[len(folders) :], strict=True)]}
    return runs


def head_cases(engine: str, work: Path) -> list[tuple[str, dict, dict]]:
    """The heads' own cases for an engine (tests/test_<part>.py's `engine_cases`), as (part, case, ours)."""
    return [(head, case, ours) for head in sorted(HEADS) if engine in HEADS[head]
            for case, ours in head_module(head).engine_cases(engine, work)]


def head_module(head: str):
    """tests/test_<head>.py, which builds the head's cases and checks them (`engine_cases`, `check_engine`)."""
    return importlib.import_module(f"test_{head}")


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_engines_load_our_folders_and_draft_as_evaluate(engine, cases, engine_runs):
    """Each engine's own drafter class, on a trained and a random folder of each variant it serves: no missing or
    unexpected weight, evaluate's block hidden states and logits within TOLERANCE, its greedy drafts (by the
    engine's drafting rule for the variant: argmax, selector, LiLiCorr walk, DSpark Markov chain, XPress Jacobi
    passes, Domino rollout) exactly evaluate's, and DSpark's confidences within TOLERANCE."""
    mine = {key: case for key, case in cases.items() if key[0] in ENGINES[engine]}
    for (key, (_, ours)), theirs in zip(mine.items(), engine_runs[engine]["folders"], strict=True):
        assert not theirs["missing"] and not theirs["unexpected"], (key, theirs["missing"], theirs["unexpected"])
        torch.testing.assert_close(theirs["hidden"], ours["hidden"], **TOLERANCE, msg=f"{key}: hidden")
        torch.testing.assert_close(theirs["logits"], ours["logits"], **TOLERANCE, msg=f"{key}: logits")
        assert theirs["drafts"].tolist() == ours["drafts"].tolist(), key
        assert (theirs["confidence"] is None) == (ours["confidence"] is None), key
        if ours["confidence"] is not None:
            torch.testing.assert_close(theirs["confidence"], ours["confidence"], **TOLERANCE, msg=f"{key}: confidence")


@pytest.mark.parametrize(("engine", "head"), [(e, h) for h in sorted(HEADS) for e in HEADS[h]])
def test_engines_heads_compute_ours(engine, head, engine_runs):
    """The engines' own heads alone on given inputs, in the same engine run as the folders: what each part's
    `check_engine` (tests/test_<part>.py) says of them."""
    mine = [(case, ours, out) for part, case, ours, out in engine_runs[engine]["heads"] if part == head]
    assert mine, f"no {head} case in the {engine} run"
    head_module(head).check_engine(engine, [(case, ours) for case, ours, _ in mine], [out for *_, out in mine])
