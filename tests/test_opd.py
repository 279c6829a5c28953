"""Draft-OPD (docs/opd.md): the accept mask and the loss against speculators', the replay against a direct target
forward, and the stage's fit: three steps, preemption and resume, non-finite steps, refusals."""

from __future__ import annotations

import csv
import json
import signal
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from test_resume import fit_args, fit_layout, recording, resume_config  # noqa: F401 (a fixture)

from dflash_lightning.blocks import FILL_IN, anchor_seed
from dflash_lightning.commands.cli import cli_main
from dflash_lightning.errors import ConfigError
from dflash_lightning.long_runs.checkpointing import load_checkpoint
from dflash_lightning.long_runs.resume import ResumeError
from dflash_lightning.opd import OPDSettings, accept_mask, opd_loss, replay, replay_mask, replay_mask_mod, slot_kls
from dflash_lightning.parts.presets import PRESETS
from dflash_lightning.target_model.features import FeatureExtractor

# -- the accept mask and the loss against speculators ------------------------------------------------------------
# Values of speculators' `build_accept_mask` and `opd_loss` (vllm-project/speculators, branch draft-opd, commit
# a3a7288fe1e9574f15d54a4c3a958823a207a4c8, src/speculators/models/opd_loss.py and the KLs of models/metrics.py),
# computed once by re-typing its formulas on these inputs: logits and targets [1, A*B, V], loss_mask [1, A*B].
B, A, V = 4, 3, 5
SPECULATORS_MASK = [[1, 0, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0]]
SPECULATORS_LOSS = {  # (gamma, lambda_acc, lambda_rej): (loss, L_acc, L_rej)
    (0.8, 1.0, 1.0): (0.6782238220139377, 0.16678448766469955, 1.1896631563631759),
    (0.5, 2.0, 0.5): (0.34892908600824224, 0.16678448766469955, 1.0775074793824129),
}


def parity_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draft and target logits `[A*B, V]` (fp32, as speculators' KLs are) and the supervised slots `[A, B]`: slot 0
    predicts nothing, the last block's last slot lies past its document."""
    i = torch.arange(A * B * V, dtype=torch.float64)
    draft = 3 * torch.sin(0.37 * i + 0.1)
    target = draft + 8.0 * torch.cos(0.23 * i + 2.1)
    supervised = torch.ones(A, B, dtype=torch.bool)
    supervised[:, 0] = False
    supervised[-1, -1] = False
    return draft.view(-1, V).float(), target.view(-1, V).float(), supervised


def test_accept_mask_and_loss_equal_speculators():
    """Through the stage's own functions (the KLs made through a head, here the identity): speculators' mask, and its
    loss, L_acc and L_rej within 1e-6, for the default settings and others."""
    draft, target, supervised = parity_inputs()
    head = torch.eye(V)
    forward_kl, reverse_kl, target_ids = slot_kls(draft, target, head, chunk=5)
    accepted = accept_mask(draft.argmax(-1).view(A, B), target_ids.view(A, B), FILL_IN)
    assert accepted.int().tolist() == SPECULATORS_MASK
    for (gamma, la, lr), expected in SPECULATORS_LOSS.items():
        loss, logs = opd_loss(forward_kl.view(A, B), reverse_kl.view(A, B), accepted, supervised,
                              OPDSettings(gamma, la, lr))
        got = (loss.item(), logs["opd/l_acc"].item(), logs["opd/l_rej"].item())
        assert got == pytest.approx(expected, abs=1e-6), (gamma, la, lr)


def test_accept_mask_is_a_running_product_from_the_first_mismatch():
    """A plain loop over each block: accepted while every draft so far matched; the fill-in anchor slot always
    matches, an anchor-first slot 0 is a draft like the others."""
    torch.manual_seed(0)
    drafts, targets = torch.randint(0, 3, (64, 6)), torch.randint(0, 3, (64, 6))
    for layout in (FILL_IN, PRESETS["dspark"].layout):
        got = accept_mask(drafts, targets, layout)
        for d, t, row in zip(drafts.tolist(), targets.tolist(), got.tolist(), strict=True):
            ok, want = True, []
            for k in range(6):
                ok = ok and (d[k] == t[k] or (k == 0 and not layout.anchor_first))
                want.append(ok)
            assert row == want


def test_loss_terms_follow_their_definitions():
    """L_acc is the plain mean of the forward KL over accepted supervised slots, L_rej the gamma**k-weighted mean of
    the reverse KL over rejected ones; a set with no rejected slot gives L_rej 0, and gradients reach only the
    slots that count."""
    fwd, rev = torch.rand(2, 5, requires_grad=True), torch.rand(2, 5, requires_grad=True)
    accepted = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    supervised = torch.tensor([[0, 1, 1, 1, 0], [0, 1, 1, 1, 1]], dtype=torch.bool)
    loss, logs = opd_loss(fwd, rev, accepted, supervised, OPDSettings(gamma=0.5, lambda_acc=3.0, lambda_rej=1.0))
    acc = [(0, 1), (1, 1), (1, 2), (1, 3), (1, 4)]
    l_acc = sum(fwd[i, k] for i, k in acc) / len(acc)
    l_rej = (rev[0, 2] * 0.5**2 + rev[0, 3] * 0.5**3) / (0.5**2 + 0.5**3)
    assert loss.item() == pytest.approx(((3 * l_acc + l_rej) / 4).item(), abs=1e-7)
    loss.backward()
    assert fwd.grad[0, 0] == 0 and rev.grad[0, 4] == 0 and rev.grad[1].abs().sum() == 0
    none_rejected, logs = opd_loss(fwd, rev, torch.ones_like(accepted), supervised, OPDSettings())
    assert logs["opd/l_rej"] == 0


# -- the replay -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def target(tiny_target) -> FeatureExtractor:
    return FeatureExtractor.from_pretrained(str(tiny_target), [1], torch.float32, "cpu", "sdpa", final_hidden=True)


def test_replay_equals_a_direct_target_forward_on_the_same_tokens(target):
    """Every block of a packed row of two documents (an invalid anchor too), replayed in one forward: each state
    equals the target's own on [the document up to the anchor + the block's tokens], run alone."""
    torch.manual_seed(0)
    lengths = [20, 17]
    vocab = target.model.config.vocab_size
    input_ids = torch.randint(0, vocab - 1, (sum(lengths),))
    position_ids = torch.cat([torch.arange(n) for n in lengths])
    anchors, valid = torch.tensor([0, 5, 19, 20, 28, 30]), torch.tensor([True] * 5 + [False])
    blocks = torch.randint(0, vocab - 1, (anchors.numel(), 4))
    blocks[:, 0] = input_ids[anchors]
    states = replay(target, input_ids, position_ids, anchors, valid, blocks)  # [A, B, H]
    starts = [0, 0, 0, 20, 20]
    for a, (p, start) in enumerate(zip(anchors[:5].tolist(), starts, strict=True)):
        ids = torch.cat([input_ids[start:p], blocks[a]])
        positions = torch.arange(ids.numel())
        alone = target.extract(ids, positions)["final_hidden"][p - start:]
        torch.testing.assert_close(states[a], alone, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(states[5]).all()  # an invalid anchor's block sees only itself


def test_the_replay_block_mask_is_its_mask_mod():
    """The flex attention form (tiles from each query's key ranges) holds exactly the dense mask's visible pairs."""
    position_ids = torch.cat([torch.arange(150), torch.arange(90)])
    anchors, valid = torch.tensor([3, 100, 149, 150, 200, 0]), torch.tensor([True] * 5 + [False])
    dense = replay_mask(position_ids, anchors, valid, 8, dense=True)[0, 0]
    tiled = replay_mask(position_ids, anchors, valid, 8, dense=False, tile=32)
    mask_mod = replay_mask_mod(position_ids, anchors, valid, 8)
    n = dense.shape[0]
    q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
    assert torch.equal(mask_mod(0, 0, q, k), dense)
    kv_num, kv_idx = tiled.kv_num_blocks[0, 0], tiled.kv_indices[0, 0]
    full_num, full_idx = tiled.full_kv_num_blocks[0, 0], tiled.full_kv_indices[0, 0]
    seen = torch.zeros(n, n, dtype=torch.bool)
    for row in range(kv_num.numel()):
        for col in [*kv_idx[row, : kv_num[row]].tolist(), *full_idx[row, : full_num[row]].tolist()]:
            seen[row * 32:(row + 1) * 32, col * 32:(col + 1) * 32] = True
    assert not (dense & ~seen).any()  # no visible pair in a skipped tile


# -- the stage in fit -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stage_config(resume_config, tmp_path_factory) -> tuple[Path, Path]:  # noqa: F811 (the imported fixture)
    """test_resume's small run as DFlash, and the checkpoint of its 2 supervised steps, the stage's starting drafter."""
    root = tmp_path_factory.mktemp("opd")
    config = yaml.safe_load(resume_config.read_text())
    config["model"]["drafter"]["variant"] = "dflash"
    config["trainer"]["max_steps"] = 2
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    cli_main(fit_args(path, root / "sft"))
    return path, next((root / "sft" / "ckpt").glob("*step=2*.ckpt"))


def logged(run: Path) -> list[dict[str, str]]:
    """The logged training rows of a run, over all its versions (a resumed run logs into a new one)."""
    return [r for path in sorted(run.rglob("metrics.csv")) for r in csv.DictReader(path.open()) if r.get("train/loss")]


def test_three_steps_of_the_stage_train_and_resume_after_sigterm(stage_config, tmp_path):
    """Three OPD steps from the supervised drafter: finite losses, the on-policy logs, the stage in the checkpoint.
    SIGTERM in step 1, then the same command: the steps after the preemption's checkpoint have the uninterrupted
    run's losses, bitwise."""
    config, sft = stage_config
    opd = ["--model.stage=opd", f"--model.init_from={sft}", "--trainer.max_steps=3"]
    cli_main(fit_args(config, tmp_path / "full", *opd))
    rows = logged(tmp_path / "full")
    assert [int(r["step"]) for r in rows] == [0, 1, 2]
    for r in rows:
        assert all(torch.isfinite(torch.tensor(float(r[k]))) for k in ("train/loss", "opd/l_acc", "opd/l_rej")
                   if k in r and r[k]), r
        assert 1 <= float(r["train/opd/tau"]) <= 8 and float(r["train/opd/rollout_s"]) > 0
    ckpt = load_checkpoint(next((tmp_path / "full" / "ckpt").glob("*step=3*.ckpt")), verify=False)
    assert ckpt["dflash_run"]["model.stage"] == "opd" and ckpt["dflash_run"]["model.opd.gamma"] == 0.8
    sigterm = "--trainer.callbacks+=" + json.dumps(
        {"class_path": "test_faults.SendSignal", "init_args": {"signum": int(signal.SIGTERM), "at_step": 1}})
    with pytest.raises(SystemExit) as stopped:
        cli_main(fit_args(config, tmp_path / "cut", *opd, sigterm))
    assert stopped.value.code == 143
    cli_main(fit_args(config, tmp_path / "cut", *opd))  # resumes from the preemption's checkpoint
    full = {r["step"]: r["train/loss"] for r in rows}
    cut = {r["step"]: r["train/loss"] for r in logged(tmp_path / "cut")}
    assert "2" in cut and all(cut[step] == full[step] for step in cut), (cut, full)


def test_a_resume_cannot_switch_stages(stage_config, tmp_path):
    """A supervised checkpoint resumed with --model.stage=opd (and the reverse is the same rule): refused before any
    step, naming both stages and the way to start a stage."""
    config, sft = stage_config
    with pytest.raises(ResumeError, match=r"its run trained stage 'sft', this one is 'opd'.*--model.init_from="):
        cli_main(fit_args(config, tmp_path / "a", f"--ckpt_path={sft}", "--model.stage=opd",
                          f"--model.init_from={sft}", "--trainer.max_steps=3"))
    assert not (tmp_path / "a" / "ckpt").exists()


def test_nonfinite_steps_are_skipped_as_in_the_supervised_stage(stage_config, tmp_path):
    """NaN features in step 1: that step updates nothing and is counted; the others train."""
    config, sft = stage_config
    poison = "--trainer.callbacks+=" + json.dumps(
        {"class_path": "test_faults.Poison", "init_args": {"key": "opd", "steps": [1]}})
    cli = cli_main(fit_args(config, tmp_path / "nan", "--model.stage=opd", f"--model.init_from={sft}",
                            "--trainer.max_steps=3", poison))
    assert cli.model.nonfinite_counts[:2].tolist() == [1, 0]
    # a step logs the counts before its own update is decided: step 1's skip shows from step 2
    assert [float(r["train/skipped_steps"]) for r in logged(tmp_path / "nan")] == [0, 0, 1]


@pytest.mark.parametrize("variant", [v for v, p in PRESETS.items() if any(part.opd_refusal for part in p.parts)])
def test_variants_the_stage_cannot_train_are_refused_naming_why(stage_config, tmp_path, variant):
    config, sft = stage_config
    with pytest.raises(ConfigError, match=rf"model.stage=opd: variant '{variant}' is not trained on-policy here: its "):
        cli_main(fit_args(config, tmp_path / "a", "--model.stage=opd", f"--model.init_from={sft}",
                          f"--model.drafter.variant={variant}"))


@pytest.mark.parametrize(("args", "message"), [
    (["--model.opd.gamma=0.5"], r"model.opd: read only with model.stage=opd"),
    (["--model.stage=opd"], r"model.stage=opd refines a trained drafter: name it with model.init_from"),
    (["--model.stage=opd", "--model.opd.gamma=0", "--model.init_from=X"], r"model.opd.gamma must be in \(0, 1\]"),
    (["--model.stage=opd", "--model.opd.sft_weight=-1", "--model.init_from=X"],
     r"model.opd.sft_weight must be a finite number >= 0, got -1"),
])
def test_settings_the_stage_cannot_use_are_refused(stage_config, tmp_path, args, message):
    config, _ = stage_config
    with pytest.raises(ConfigError, match=message):
        cli_main(fit_args(config, tmp_path / "a", *args))


def test_the_approximation_needs_no_replay_and_differs_from_it(stage_config, tmp_path):
    """--model.opd.replay=false: no target forward of the drafts; a step's loss differs from the exact replay's (the
    data continuation is not the draft's)."""
    config, sft = stage_config
    losses = {}
    for replay_on in ("true", "false"):
        run = tmp_path / replay_on
        cli_main(fit_args(config, run, "--model.stage=opd", f"--model.init_from={sft}", "--trainer.max_steps=1",
                          f"--model.opd.replay={replay_on}"))
        losses[replay_on] = float(logged(run)[0]["train/loss"])
    assert losses["true"] != losses["false"]


def test_the_sft_term_adds_the_supervised_loss_of_the_same_blocks(stage_config, tmp_path):
    """--model.opd.sft_weight=w: a step's loss is the paper's loss (w 0) plus w times the supervised stage's loss of
    the same batch and anchors (logged as opd/sft), that of a supervised step from the same drafter."""
    config, sft = stage_config
    first = {}
    for name, args in {"opd": ["--model.stage=opd"], "mixed": ["--model.stage=opd", "--model.opd.sft_weight=0.5"],
                       "sft": []}.items():
        cli_main(fit_args(config, tmp_path / name, f"--model.init_from={sft}", "--trainer.max_steps=1", *args))
        first[name] = logged(tmp_path / name)[0]
    supervised = float(first["mixed"]["train/opd/sft"])
    assert supervised == pytest.approx(float(first["sft"]["train/loss"]), rel=1e-5)
    assert float(first["mixed"]["train/loss"]) == pytest.approx(float(first["opd"]["train/loss"]) + 0.5 * supervised,
                                                                rel=1e-5)
    assert "train/opd/sft" not in first["opd"] or not first["opd"]["train/opd/sft"]


def test_slot_kls_chunks_equal_one_pass():
    torch.manual_seed(0)
    d, t, head = torch.randn(10, 6, dtype=torch.float64), torch.randn(10, 6, dtype=torch.float64), torch.randn(7, 6)
    one = slot_kls(d, t, head.double(), chunk=10)
    parts = slot_kls(d, t, head.double(), chunk=3)
    for x, y in zip(one, parts, strict=True):
        assert torch.equal(x, y)
    log_q, log_p = F.log_softmax(d @ head.double().T, -1), F.log_softmax(t @ head.double().T, -1)
    torch.testing.assert_close(one[0], (log_p.exp() * (log_p - log_q)).sum(-1))


# the GPU config on this machine: its target and data swapped for the tiny ones, the CPU in place of the GPU
ON_THE_CPU = ["--target.path=dflash_lightning/assets/tiny/target_model", "--target.dtype=float32",
              "--target.compile=false", "--model.compile=false", "--trainer.accelerator=cpu",
              "--trainer.precision=32-true", "--data.train_files=[dflash_lightning/assets/tiny/data/train.jsonl]",
              "--data.val_files=[dflash_lightning/assets/tiny/data/val.jsonl]"]


@pytest.mark.parametrize(("name", "overrides"), [("tiny-opd.yaml", []), ("smollm2-135m-opd-gpu.yaml", ON_THE_CPU)])
def test_the_shipped_stage_configs_parse_and_instantiate(stage_config, tmp_path, monkeypatch, name, overrides):
    """configs/stages/*.yaml (outside configs/*.yaml: their init_from is a run's output) on a tiny stand-in."""
    _, sft = stage_config
    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)  # the configs' paths are the repository's
    cli = cli_main(["--config", str(root / "configs" / "stages" / name), f"--model.init_from={sft}",
                    "--trainer.max_steps=1", f"--trainer.default_root_dir={tmp_path}", *overrides], run=False)
    assert cli.model.hparams.stage == "opd" and cli.model.replays and cli.model.opd_settings == OPDSettings()
    assert cli.model.drafter_config.variant == "dflash"


@pytest.mark.parametrize(("placement", "cache"), [("separate", None), ("engine", None), ("colocated", "cache/")])
def test_replay_refuses_a_target_away_from_the_trainer(placement, cache):
    """Exact replay runs the target on the trainer's devices every step: a separate or engine placement, or a feature
    cache (no target at all), is refused naming the setting and the way out; the approximation is not."""
    from types import SimpleNamespace

    from dflash_lightning.target_model.wiring import check_wiring

    target = SimpleNamespace(placement=placement, feature_cache=cache)
    with pytest.raises(ConfigError, match=r"^model.opd.replay: .*--model.opd.replay=false$"):
        check_wiring(SimpleNamespace(replays=True), None, target)


def test_the_ab_recipes_start_each_arm_from_the_400_step_supervised_run(tmp_path, monkeypatch):
    """benchmarks/objective_ab.py: "@recipe/400" is that recipe's run of 400 steps, fitted first, whatever the arm's
    own steps; every arm starts from that one checkpoint."""
    import sys

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "benchmarks"))
    try:
        import objective_ab
    finally:
        sys.path.pop(0)
    fits = []

    def fake_run(cmd, **kwargs):  # a fit: its config's max_steps recorded, a checkpoint in its folder
        config = Path(cmd[cmd.index("--config") + 1])
        fits.append((config.parent.name, yaml.safe_load(config.read_text())["trainer"]["max_steps"]))
        (config.parent / "checkpoints").mkdir(exist_ok=True)
        (config.parent / "checkpoints/last.ckpt").write_bytes(b"")

    monkeypatch.setattr(objective_ab.subprocess, "run", fake_run)
    base = yaml.safe_load((root / "configs/tiny.yaml").read_text())
    runs = [objective_ab.one_run(name, 0, tmp_path, base, "configs/tiny.yaml", steps=200, fit_only=True)
            for name in ("sft-continued", "opd", "opd-approx")]
    assert fits == [("dflash-dpace-ce-steps400-seed0", 400), ("sft-continued-steps200-seed0", 200),
                    ("opd-steps200-seed0", 200), ("opd-approx-steps200-seed0", 200)]
    start = str(tmp_path / "dflash-dpace-ce-steps400-seed0/checkpoints/last.ckpt")
    assert all(r["settings"]["model.init_from"] == start for r in runs)
    assert [r["settings"].get("model.stage") for r in runs] == [None, "opd", "opd"]


def test_two_ddp_ranks_roll_out_their_own_rows_and_keep_equal_weights(stage_config, tmp_path):
    """`--trainer.strategy=ddp --trainer.devices=2` (gloo, two processes as a user starts them), 3 OPD steps of one
    row per rank: each step's two rows (their documents, anchors and so drafts, keyed by `anchor_seed`) differ
    between the ranks and together are the global batch, every row of the epoch once; after every step both ranks
    hold the same weights, which the steps changed."""
    config, sft = stage_config
    run = tmp_path / "ddp"
    fit_layout(config, run, "ddp x2", *recording(run)[1:], "--model.stage=opd", f"--model.init_from={sft}",
               "--trainer.max_steps=3")
    where = {anchor_seed(0, "train", 0, i): i for i in range(32)}  # the row's index in epoch 0's global stream
    rows = {rank: [line.split() for line in (run / f"rank{rank}.txt").read_text().splitlines()] for rank in (0, 1)}
    by_step = [[where[int(rows[rank][step][1])] for rank in (0, 1)] for step in range(3)]
    assert all(int(rows[r][s][2]) == s for r in (0, 1) for s in range(3))
    assert sorted(i for pair in by_step for i in pair) == list(range(6))  # disjoint, and each step its global batch
    digests = [line.split() for line in (run / "weights.txt").read_text().splitlines()]
    by_rank_step = {step: {d for s, d in digests if int(s) == step} for step in (1, 2, 3)}
    assert len(digests) == 6 and all(len(d) == 1 for d in by_rank_step.values()), digests  # the ranks agree
    assert len(set.union(*by_rank_step.values())) == 3  # and every step moved them
