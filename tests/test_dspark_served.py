"""DSpark's served report and calibration (docs/dspark.md) against plain references written here: the paper's survival
measures (ECE in 20 bins, AUROC, Brier per position), the engines' adaptive-verification rule with lagged
confidences, the calibration fit on a planted miscalibration, the fold into `confidence_head.proj` (vLLM's own head
on the folded weights: tests/test_dspark.py's `check_engine`, run by tests/test_engine_drafts.py), and the calibrate
/ evaluate / export commands end to end."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
from test_dspark import B, V, dspark_for, random_dspark, target  # noqa: F401 (fixture)
from test_evaluate import PROMPTS

from dflash_lightning.config import ConfigError, DrafterConfig
from dflash_lightning.decoding.calibration import fold
from dflash_lightning.decoding.evaluate import verified_lengths
from dflash_lightning.parts.base import ServedSettings, VerifyCost
from dflash_lightning.parts.dspark import (
    DSparkHeads,
    DSparkSettings,
    ServedStep,
    adaptive_verification,
    auroc,
    fit_affine,
    fit_sts,
    served_blocks,
    survival_calibration,
)


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def planted_steps(n: int, drafts: int, scale: float, shift: float, seed: int = 0) -> list[ServedStep]:
    """Served steps whose true P(draft k accepted | drafts before it accepted) is sigmoid(scale * logit_k + shift):
    a head that reports sigmoid(logit) is miscalibrated by that map. The last step of every 10th is cut short."""
    rng = random.Random(seed)
    steps = []
    for i in range(n):
        logits = [rng.gauss(2.0, 1.5) for _ in range(drafts)]
        accepted = next((k for k, x in enumerate(logits) if rng.random() >= sigmoid(scale * x + shift)), drafts)
        verified = drafts if i % 10 else rng.randrange(drafts + 1)
        steps.append(ServedStep(tuple(logits), min(accepted, verified), verified))
    return steps


def same(a, b) -> bool:
    """Equal trees of dicts, lists and numbers, numbers to 1e-12 (sigmoids computed two ways differ in the last bit)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b if a is None or b is None else math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-12)


def ece_reference(pairs: list[tuple[float, float]], bins: int) -> float:
    """sum over bins of |sum p - sum y| / n, bin b holding b/bins <= p < (b+1)/bins (1.0 in the last)."""
    total = 0.0
    for b in range(bins):
        inside = [(p, y) for p, y in pairs if b / bins <= p < (b + 1) / bins or (b == bins - 1 and p == 1.0)]
        total += abs(sum(p for p, _ in inside) - sum(y for _, y in inside))
    return total / len(pairs)


def auroc_reference(scores: list[float], labels: list[float]) -> float:
    """Every (positive, negative) pair: 1 if the positive scores higher, 1/2 on a tie."""
    pos = [s for s, y in zip(scores, labels, strict=True) if y]
    neg = [s for s, y in zip(scores, labels, strict=True) if not y]
    return sum(1.0 if p > q else 0.5 if p == q else 0.0 for p in pos for q in neg) / (len(pos) * len(neg))


# -- the paper's measures -----------------------------------------------------------------------------------------
def test_survival_measures_against_plain_references():
    """Per position k: a_k = prod_{i<=k} sigmoid(logit_i) against [a > k] over the steps that verified draft k;
    ECE in 20 bins, AUROC with ties, Brier; the means weighted by pairs."""
    steps = planted_steps(300, 5, 0.6, -0.8)
    steps += [ServedStep((0.0,) * 5, 2, 5)] * 4  # tied scores
    report = survival_calibration(steps, lambda k, x: sigmoid(x))
    weights, eces, aurocs, briers = [], [], [], []
    for k in range(5):
        pairs = [(math.prod(sigmoid(x) for x in s.logits[: k + 1]), float(s.accepted > k))
                 for s in steps if s.verified > k]
        position = report["per_position"][k]
        assert position["pairs"] == len(pairs)
        assert position["ece"] == pytest.approx(ece_reference(pairs, 20))
        assert position["auroc"] == pytest.approx(auroc_reference(*zip(*pairs, strict=True)))
        assert position["brier"] == pytest.approx(sum((p - y) ** 2 for p, y in pairs) / len(pairs))
        weights.append(len(pairs)), eces.append(position["ece"]), aurocs.append(position["auroc"])
        briers.append(position["brier"])
    assert report["ece"] == pytest.approx(sum(w * e for w, e in zip(weights, eces, strict=True)) / sum(weights))
    assert report["auroc"] == pytest.approx(sum(w * e for w, e in zip(weights, aurocs, strict=True)) / sum(weights))
    assert report["brier"] == pytest.approx(sum(w * e for w, e in zip(weights, briers, strict=True)) / sum(weights))
    assert report["served_tau"] == pytest.approx(1 + sum(s.accepted for s in steps) / len(steps))
    assert auroc([0.1, 0.2], [1, 1]) is None and auroc([0.3, 0.3, 0.9], [0, 1, 1]) == pytest.approx(0.75)


def test_served_blocks_read_the_records_and_the_verified_drafts():
    """A step's logits (or, in records written before they were kept, the logit of c), accepted and verified drafts;
    a record without confidences gives none. Verified drafts: all but where the length limit cut the step."""
    records = [{"accepted_lengths": [2, 0], "verified_lengths": [4, 1],
                "extras": {"confidence": [[0.5] * 4] * 2, "confidence_logit": [[0.0, 1.0, 2.0, 3.0], [1.0] * 4]}},
               {"accepted_lengths": [3], "extras": {"confidence": [[0.5, 0.75, 0.5, 0.5]]}},
               {"accepted_lengths": [1], "extras": {}}]
    first, second, third = served_blocks(records)
    assert first == [ServedStep((0.0, 1.0, 2.0, 3.0), 2, 4), ServedStep((1.0,) * 4, 0, 1)]
    assert second[0].logits == pytest.approx((0.0, math.log(3), 0.0, 0.0)) and second[0].verified == 4
    assert third == []


def test_verified_lengths_are_what_the_decoder_verified(target, monkeypatch):  # noqa: F811
    """`verified_lengths` from the accepted counts and the length limit equals the drafts the decoder hands
    verification at every step (the last step cut short by the limit)."""
    from dflash_lightning.decoding import speculative

    seen, verify = [], speculative.verify_drafts
    monkeypatch.setattr(speculative, "verify_drafts", lambda drafts, *a, **k: seen.append(len(drafts)) or
                        verify(drafts, *a, **k))
    decoder = speculative.SpeculativeDecoder(target, dspark_for(target, seed=3))
    for limit in (7, 10, 13):
        seen.clear()
        out = decoder.generate(torch.tensor([5, 9, 17, 4]), limit)
        assert verified_lengths(out.accepted_lengths, decoder.drafts, limit) == seen, limit


# -- adaptive verification ------------------------------------------------------------------------------------------
def engine_rule_reference(prompts: list[list[ServedStep]], cost: VerifyCost, lag: int, floor: float = 0.0
                          ) -> tuple[float, float]:
    """Verified and accepted drafts a step: n of a step maximises (1 + the n largest survivals at or above `floor` of
    the step `lag` before, all ones without one) / (draft + 1 + per_token * n), the smallest n on ties; it accepts
    min(a, n)."""
    verified = accepted = 0
    steps = [s for p in prompts for s in p]
    for prompt in prompts:
        for t, step in enumerate(prompt):
            old = prompt[t - lag].logits if t >= lag else None
            survival = [1.0] * len(step.logits) if old is None else \
                [math.prod(sigmoid(x) for x in old[: k + 1]) for k in range(len(old))]
            eligible = sorted([a for a in survival[: step.verified] if a >= floor], reverse=True)
            values = [(1 + sum(eligible[:n])) / (cost.draft + 1 + cost.per_token * n) for n in range(len(eligible) + 1)]
            n = values.index(max(values))
            verified, accepted = verified + n, accepted + min(step.accepted, n)
    return verified / len(steps), accepted / len(steps)


@pytest.mark.parametrize("cost", [VerifyCost(0.1, 0.05), VerifyCost(0.3, 0.3), VerifyCost(0.0, 0.0)])
def test_adaptive_verification_simulates_the_engines_rule(cost):
    prompts = [planted_steps(n, 6, 0.7, -0.5, seed=n) for n in (1, 2, 7, 30)]
    prompts[3][5] = ServedStep((-4.0,) * 6, 0, 6)  # survivals below SGLang's floor of 1e-6 from slot 3 on
    report = adaptive_verification(prompts, cost)
    steps = sum(map(len, prompts))
    for name, lag, floor in (("vllm", 1, 0.0), ("sglang", 2, 1e-6), ("current", 0, 0.0)):
        verified, accepted = engine_rule_reference(prompts, cost, lag, floor)
        assert report[name]["verified_per_step"] == pytest.approx(verified), name
        assert report[name]["accepted_per_step"] == pytest.approx(accepted), name
        spent = cost.draft + 1 + cost.per_token * verified  # a step's mean cost
        assert report[name]["cost_per_step"] == pytest.approx(spent)
        assert report[name]["tokens_per_cost"] == pytest.approx((1 + accepted) / spent)
    everything = [s for p in prompts for s in p]
    assert report["all"]["verified_per_step"] == pytest.approx(sum(s.verified for s in everything) / steps)
    assert report["all"]["tau"] == pytest.approx(1 + sum(s.accepted for s in everything) / steps)
    if cost.per_token == 0:  # a free draft is always worth verifying: the rule verifies all
        assert report["vllm"]["verified_per_step"] == report["all"]["verified_per_step"]


def test_adaptive_verification_by_hand():
    """Two steps of one prompt, 3 drafts, cost 1 + 0.25 n: step 0 sees no history (all ones: (1 + n) / (1 + 0.25 n)
    grows, n = 3); step 1 under vLLM sees step 0's survivals 0.9, 0.45, 0.045: values 1, 1.52, 1.57, 1.37: n = 2,
    of which it accepts 2 (all 3 were accepted)."""
    logit = lambda c: math.log(c / (1 - c))  # noqa: E731
    prompts = [[ServedStep((logit(0.9), logit(0.5), logit(0.1)), 1, 3), ServedStep((logit(0.2),) * 3, 3, 3)]]
    report = adaptive_verification(prompts, VerifyCost(0.0, 0.25))
    assert report["vllm"]["verified_per_step"] == pytest.approx((3 + 2) / 2)
    assert report["vllm"]["accepted_per_step"] == pytest.approx((1 + 2) / 2)
    assert report["sglang"]["verified_per_step"] == pytest.approx(3.0)  # two steps back: none yet, all ones


def test_served_report_views_and_engines():
    """Without a calibration the report has the raw view; with one, SGLang's per-slot temperatures and the affine
    map too, and each engine's rule runs on the confidences it serves (vLLM the folded head, SGLang the sts file)."""
    steps = planted_steps(60, B, 0.5, -1.0)
    records = [{"accepted_lengths": [s.accepted for s in steps], "verified_lengths": [s.verified for s in steps],
                "extras": {"confidence_logit": [list(s.logits) for s in steps]}}]
    raw = DSparkHeads.served_report(records)
    assert set(raw["confidence_calibration"]["survival"]) == {"raw"}
    fit = {"sts_temperatures": [2.0] * B, "affine": {"scale": 0.5, "shift": -1.0}}
    report = DSparkHeads.served_report(records, ServedSettings(VerifyCost(), {"dspark_heads": fit}))
    survival = report["confidence_calibration"]["survival"]
    assert same(survival["affine"], survival_calibration(steps, lambda k, x: sigmoid(0.5 * x - 1.0)))
    assert same(survival["sts"], survival_calibration(steps, lambda k, x: sigmoid(x / 2.0)))
    assert same(report["adaptive_verification"]["vllm"], adaptive_verification(
        [steps], VerifyCost(), {"vllm": lambda k, x: sigmoid(0.5 * x - 1.0)})["vllm"])
    assert same(report["adaptive_verification"]["sglang"], adaptive_verification(
        [steps], VerifyCost(), {"sglang": lambda k, x: sigmoid(x / 2.0)})["sglang"])
    assert DSparkHeads.served_report([{"accepted_lengths": [1], "extras": {}}]) == {}


# -- the calibration fit ---------------------------------------------------------------------------------------------
def test_calibration_fit_corrects_a_planted_miscalibration():
    """A head whose c = sigmoid(logit) while the truth is sigmoid(0.5 logit - 1): the affine fit finds the map and
    the survival ECE falls from over 0.2 to under 0.02 on other steps of the same kind; the per-slot temperatures
    (which cannot shift) lower it too, and SGLang's file holds them."""
    fit_steps, held = planted_steps(3000, 6, 0.5, -1.0, seed=1), planted_steps(3000, 6, 0.5, -1.0, seed=2)
    scale, shift = fit_affine(fit_steps)
    assert scale == pytest.approx(0.5, abs=0.05) and shift == pytest.approx(-1.0, abs=0.1)
    raw = survival_calibration(held, lambda k, x: sigmoid(x))
    affine = survival_calibration(held, lambda k, x: sigmoid(scale * x + shift))
    assert raw["ece"] > 0.2 and affine["ece"] < 0.02
    temperatures = fit_sts(fit_steps, 6)
    sts = survival_calibration(held, lambda k, x: sigmoid(x / temperatures[k]))
    assert sts["ece"] < raw["ece"] / 2 and all(t > 1 for t in temperatures)  # overconfident: every slot softened

    state = {"confidence_head.proj.weight": torch.ones(1, 3), "confidence_head.proj.bias": torch.zeros(1)}
    records = [{"accepted_lengths": [s.accepted for s in fit_steps[:400]],
                "verified_lengths": [s.verified for s in fit_steps[:400]],
                "extras": {"confidence_logit": [list(s.logits) for s in fit_steps[:400]]}}]
    fitted = DSparkHeads.calibrate(records, state)
    sglang = json.loads(fitted.files["sts.json"])  # SGLang's DSparkStsCalibration: temperatures > 0, one a draft
    assert set(sglang) <= {"temperatures", "dataset", "num_samples", "ece_before", "ece_after"}
    assert len(sglang["temperatures"]) == 6 and min(sglang["temperatures"]) > 0 and sglang["num_samples"] == 400
    assert fitted.fit["sts_temperatures"] == sglang["temperatures"] and fitted.fit["drafts"] == 6
    assert fitted.report["survival"]["affine"]["ece"] < fitted.report["survival"]["raw"]["ece"]


def test_fold_gives_the_calibrated_confidence_and_refuses_another_head():
    drafter = random_dspark(seed=7).float()
    part = drafter.parts[0]
    state = {k: v.clone() for k, v in drafter.state_dict().items()}
    fit = {"affine": {"scale": 0.7, "shift": -0.4}, "head": {"weight_norm": float(
        state["confidence_head.proj.weight"].double().norm()), "bias": float(state["confidence_head.proj.bias"])}}
    folded = DSparkHeads.fold_calibration(state, fit, "c.json")
    assert {k for k in state if not torch.equal(state[k], folded[k])} == {"confidence_head.proj.weight",
                                                                         "confidence_head.proj.bias"}
    hidden, prev = torch.randn(9, drafter.config.hidden_size), torch.randint(0, V, (9,))
    raw = part.confidence_head(hidden, part._markov_rows(prev))
    drafter.load_state_dict(folded)
    torch.testing.assert_close(part.confidence_head(hidden, part._markov_rows(prev)), 0.7 * raw - 0.4)
    with pytest.raises(ConfigError, match="c.json: calibrated for a confidence head of"):
        DSparkHeads.fold_calibration(folded, fit, "c.json")  # folded twice
    with pytest.raises(ConfigError, match="c.json: not a DSpark calibration"):
        DSparkHeads.fold_calibration(state, {"affine": {}}, "c.json")


def test_verify_cost_is_checked():
    with pytest.raises(ConfigError, match="verify_cost.per_token must be a finite number >= 0"):
        VerifyCost(0.1, -0.5)
    with pytest.raises(ConfigError, match="verify_cost.draft"):
        VerifyCost(float("nan"), 0.1)


# -- the commands ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dspark_checkpoint(tiny_target, tmp_path_factory):
    """A real checkpoint of a DSpark module after one training step on the tiny target."""
    from helpers import packed_batch
    from lightning.pytorch import Trainer
    from torch.utils.data import DataLoader

    from dflash_lightning.module import DFlashModule
    from dflash_lightning.target_model import TargetFeatures

    torch.manual_seed(0)
    cfg = DrafterConfig(num_layers=1, block_size=4, variant="dspark", dspark_heads=DSparkSettings(markov_rank=8))
    module = DFlashModule(str(tiny_target), cfg, token_budget=64, num_anchors=8, objective="ce", loss_weights="decay")
    features = TargetFeatures(str(tiny_target), dtype="float32", layer_ids=module.drafter_config.target_layer_ids,
                              final_hidden=True)
    trainer = Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[features])
    trainer.fit(module, train_dataloaders=DataLoader([packed_batch([30, 20], 64, vocab=50)], batch_size=None))
    path = tmp_path_factory.mktemp("dspark") / "last.ckpt"
    trainer.save_checkpoint(path)
    return path


def test_calibrate_evaluate_and_export_end_to_end(dspark_checkpoint, tmp_path, capsys):
    """calibrate writes calibration.json and SGLang's file per temperature; evaluate --calibration reports the
    confidences raw, with the per-slot temperatures and with the affine map; export --calibration folds the map into
    the folder's confidence head and prints a vLLM command with adaptive verification on."""
    from safetensors.torch import load_file

    from dflash_lightning.commands.calibrate import main as calibrate
    from dflash_lightning.commands.evaluate import main as evaluate
    from dflash_lightning.commands.export import export
    from dflash_lightning.folder.reader import read_checkpoint

    cal_file, eval_file = tmp_path / "cal.jsonl", tmp_path / "eval.jsonl"
    cal_file.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS[:2]))
    eval_file.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS[2:]))
    common = ["--drafter", str(dspark_checkpoint), "--max_new_tokens", "12", "--device", "cpu", "--dtype", "float32",
              "--temperature", "0,1"]
    calibrate([*common, "--prompts", str(cal_file), "--eval_prompts", str(eval_file), "--out", str(tmp_path / "c")])
    table = json.loads((tmp_path / "c" / "calibration.json").read_text())
    assert list(table["per_temperature"]) == ["0", "1"]
    for key, entry in table["per_temperature"].items():
        part = entry["parts"]["dspark_heads"]
        assert part["files"] == {"sts.json": f"sts-T{key}.json"}
        sts = json.loads((tmp_path / "c" / f"sts-T{key}.json").read_text())
        assert sts["temperatures"] == part["fit"]["sts_temperatures"] and len(sts["temperatures"]) == 4
    assert "export --checkpoint" in capsys.readouterr().out

    evaluate([*common, "--prompts", str(eval_file), "--calibration", str(tmp_path / "c" / "calibration.json"),
              "--out", str(tmp_path / "e"), "--verify_cost.per_token", "0.2"])
    report = json.loads((tmp_path / "e" / "report.json").read_text())
    for run in report["per_temperature"].values():
        assert set(run["confidence_calibration"]["survival"]) == {"raw", "sts", "affine"}
        assert run["adaptive_verification"]["cost"] == {"draft": 0.1, "per_token": 0.2}
        for p in run["prompts"]:
            assert [len(v) for v in p["extras"]["confidence_logit"]] == [4] * p["steps"]

    calibration = str(tmp_path / "c" / "calibration.json")
    with pytest.raises(ConfigError, match="say which one the folder is served at"):
        export(checkpoint=str(dspark_checkpoint), out=str(tmp_path / "f"), calibration=calibration)
    with pytest.raises(ConfigError, match=r"no calibration for temperature 0.6 \(it has 0, 1\)"):
        export(checkpoint=str(dspark_checkpoint), out=str(tmp_path / "f"), calibration=calibration,
               calibration_temperature=0.6)
    assert not (tmp_path / "f").exists()
    capsys.readouterr()
    export(checkpoint=str(dspark_checkpoint), out=str(tmp_path / "f"), calibration=calibration,
           calibration_temperature=1)
    printed = capsys.readouterr().out
    assert '"enable_adaptive_verification": true' in printed and '"num_speculative_tokens": 4' in printed
    _, state, _ = read_checkpoint(dspark_checkpoint)
    affine = table["per_temperature"]["1"]["parts"]["dspark_heads"]["fit"]["affine"]
    folded = load_file(tmp_path / "f" / "model.safetensors")
    torch.testing.assert_close(folded["confidence_head.proj.weight"],
                               state["confidence_head.proj.weight"] * affine["scale"])
    torch.testing.assert_close(folded["confidence_head.proj.bias"],
                               state["confidence_head.proj.bias"] * affine["scale"] + affine["shift"])
    assert all(torch.equal(folded[k], v) for k, v in state.items() if not k.startswith("confidence_head."))


def test_commands_refuse_before_decoding(dspark_checkpoint, tmp_path):
    """A calibration prompt that is also an evaluation prompt, a temperature the calibration has no fit for, and a
    file that is not a calibration are refused in one line naming the file."""
    from dflash_lightning.commands.calibrate import calibrate_drafter
    from dflash_lightning.commands.evaluate import evaluate_drafter

    cal_file, eval_file = tmp_path / "cal.jsonl", tmp_path / "eval.jsonl"
    cal_file.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    answered = {**PROMPTS[1], "messages": [*PROMPTS[1]["messages"], {"role": "assistant", "content": "other"}]}
    eval_file.write_text(json.dumps(answered) + "\n")  # the same prompt with another answer is the same prompt
    with pytest.raises(ConfigError, match=f"{cal_file}: prompts on lines 2 are also in {eval_file}"):
        calibrate_drafter(drafter=str(dspark_checkpoint), prompts=str(cal_file), eval_prompts=str(eval_file))
    table = {"format": "dflash_lightning calibration 1", "per_temperature": {"1": {"parts": {"dspark_heads": {
        "fit": {}}}}}}
    (tmp_path / "c.json").write_text(json.dumps(table))
    with pytest.raises(ConfigError, match=r"c.json: no calibration for temperature 0 \(it has 1\)"):
        evaluate_drafter(drafter=str(dspark_checkpoint), prompts=str(eval_file), calibration=str(tmp_path / "c.json"),
                         temperature="0,1")
    (tmp_path / "c.json").write_text(json.dumps({"per_temperature": []}))
    with pytest.raises(ConfigError, match="c.json: not a calibration file of `calibrate`"):
        evaluate_drafter(drafter=str(dspark_checkpoint), prompts=str(eval_file), calibration=str(tmp_path / "c.json"))
    with pytest.raises(ConfigError, match="c.json: fits parts lilicorr; this drafter's parts that calibrate: "
                                          "dspark_heads"):
        fold((DSparkHeads,), {}, {"lilicorr": {}}, "c.json")
    with pytest.raises(ConfigError, match="this drafter's parts that calibrate: none"):
        fold((), {}, {}, "c.json")
