"""Evaluation end to end on a tiny target: reports written, no mismatches; the summary arithmetic by hand."""

from __future__ import annotations

import json

import pytest
import torch
from test_export import make_checkpoint
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_lightning.commands.evaluate import main
from dflash_lightning.config import DrafterConfig
from dflash_lightning.decoding.evaluate import evaluate, first_mismatch, parse_temperatures, prompt_ids, summarize
from dflash_lightning.decoding.speculative import Generation
from dflash_lightning.folder.writer import export_checkpoint
from dflash_lightning.model import DFlashDrafter

PROMPTS = [
    {"prompt": "what does this function return ?", "category": "code"},
    {"messages": [{"role": "user", "content": "explain the list"}, {"role": "assistant", "content": "a list"}],
     "category": "chat"},
    {"messages": [{"role": "system", "content": "be a python module"}, {"role": "user", "content": "the value"}],
     "category": "chat"},
    {"prompt": "a string is an object of a class"},
]


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in PROMPTS))
    return path


def test_evaluate_cut_short_keeps_the_temperatures_it_finished(tiny_target, prompts_file, tmp_path, monkeypatch):
    import dflash_lightning.commands.evaluate as command

    measured = command.evaluate

    def cut_at_t1(*args, temperature, **kwargs):  # a preemption in the second temperature
        if temperature == 1:
            raise KeyboardInterrupt
        return measured(*args, temperature=temperature, **kwargs)

    monkeypatch.setattr(command, "evaluate", cut_at_t1)
    out = tmp_path / "eval"
    with pytest.raises(KeyboardInterrupt):
        main(["--drafter", str(make_checkpoint(tiny_target, tmp_path / "last.ckpt")), "--prompts", str(prompts_file),
              "--out", str(out), "--max_new_tokens", "6", "--num_prompts", "1", "--device", "cpu",
              "--temperature", "0,1"])
    report = json.loads((out / "report.json").read_text())
    assert list(report["per_temperature"]) == ["0"] and not report["complete"] and report["num_prompts"] == 1


def test_evaluate_command_end_to_end(tiny_target, prompts_file, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "160")  # the summary table unwrapped
    checkpoint = make_checkpoint(tiny_target, tmp_path / "last.ckpt")
    out = tmp_path / "eval"
    sampling = ["--temperature", "0,1", "--top_k", "20", "--seed", "3"]
    main(["--drafter", str(checkpoint), "--prompts", str(prompts_file), "--out", str(out), "--max_new_tokens", "12",
          "--device", "cpu", "--dtype", "float32", *sampling])  # the target comes from the checkpoint
    report = json.loads((out / "report.json").read_text())
    assert (out / "report.png").stat().st_size > 1000
    assert list(report["per_temperature"]) == ["0", "1"] and report["complete"]
    greedy, sampled = report["per_temperature"].values()
    assert {k: v for k, v in report.items() if k in greedy} == greedy  # the first temperature's at the top
    assert sampled["seed"] == 3 and sampled["top_k"] == 20 and sampled["temperature"] == 1
    assert greedy["mismatches"] == 0 and greedy["num_prompts"] == 4
    assert sampled["mismatches"] is None and sampled["num_prompts"] == 4  # samples differ from the target's by design
    for run in report["per_temperature"].values():
        assert sum(run["acceptance_histogram"]) == run["steps"] > 0
        assert len(run["acceptance_histogram"]) == 8 and len(run["slot_acceptance"]) == 7
        assert 1 <= run["tau_pooled"] <= 8 and 1 <= run["tau_prompt_mean"] <= 8 and run["speedup"] > 0
        assert 1 <= run["expected_tau_pooled"] <= 8
        for p in run["prompts"]:  # every new token but the prefill's is counted once, by some step
            assert sum(p["step_tokens"]) == p["new_tokens"] - 1 and p["tau"] == sum(p["step_tokens"]) / p["steps"]
            assert len(p["expected_accepted"]) == p["steps"]
        assert set(run["per_category"]) == {"chat", "code"} and run["per_category"]["chat"]["num_prompts"] == 2
    # greedy: P_k(d_k) is 0 or 1, so the expected count is the accepted one (the last step counted whole)
    assert greedy["expected_tau_pooled"] == pytest.approx(1 + sum(greedy["acceptance_histogram"][a] * a
                                                                  for a in range(8)) / greedy["steps"])
    printed = capsys.readouterr().out  # the rich summary table
    assert "tau pooled" in printed and "tau prompt mean" in printed and "expected tau" in printed

    # an exported folder with an explicit target gives the same decoding, sampled ones too (the same seed);
    # `--baseline greedy` runs the target alone at T 0 only: no speedup at T 1, the same drafts
    folder = export_checkpoint(checkpoint, tmp_path / "folder")
    main(["--drafter", str(folder), "--target", str(tiny_target), "--prompts", str(prompts_file), "--out",
          str(tmp_path / "eval2"), "--max_new_tokens", "12", "--num_prompts", "2", "--device", "cpu",
          "--dtype", "float32", "--baseline", "greedy", *sampling])
    report2 = json.loads((tmp_path / "eval2" / "report.json").read_text())
    assert report2["num_prompts"] == 2 and report2["mismatches"] == 0 and report2["speedup"] > 0
    assert report2["per_temperature"]["1"]["speedup"] is None
    assert all(p["target_seconds"] is None for p in report2["per_temperature"]["1"]["prompts"])
    for run2, run in zip(report2["per_temperature"].values(), report["per_temperature"].values(), strict=True):
        for a, b in zip(run2["prompts"], run["prompts"][:2], strict=True):
            assert {k: v for k, v in a.items() if not k.endswith("seconds")} == \
                {k: v for k, v in b.items() if not k.endswith("seconds")}


def test_evaluate_in_memory_drafter_without_target_io(tiny_target):
    """What training-time validation does: a fresh drafter object, the target already loaded."""
    target = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    cfg = DrafterConfig(num_layers=1, block_size=4, mask_token_id=52, gamma=4.0).resolved(target.config)
    drafter = DFlashDrafter(cfg)
    drafter.train()
    report = evaluate(drafter, target, tokenizer, PROMPTS[:2], max_new_tokens=10, progress=False)
    assert report["mismatches"] == 0 and report["block_size"] == 4
    assert drafter.training and drafter.head_weight is not None  # mode restored, the target's head attached


def test_prompt_rows_become_chat_prompts(tiny_target):
    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    ids = prompt_ids(tokenizer, PROMPTS[1])
    text = tokenizer.decode(ids)
    assert text.count("<|im_start|>") == 2 and "a list" not in text  # the answer is dropped
    assert tokenizer.convert_ids_to_tokens(ids[-2:]) == ["<|im_start|>", "assistant"]  # the generation prompt
    with pytest.raises(ValueError, match="'messages' or 'prompt'"):
        prompt_ids(tokenizer, {"text": "hi"})


def test_temperatures_are_parsed_and_checked(prompts_file, tmp_path):
    assert parse_temperatures("0,0.6,1") == parse_temperatures("[0, 0.6, 1]") == parse_temperatures([0, 0.6, 1.0])
    assert parse_temperatures(0.7) == [0.7] and parse_temperatures("0") == [0.0]
    for bad, message in (("0,hot", "'hot' is not a number"), ("0.6,-1", "temperature must be >= 0"),
                         ("1,1", "distinct")):
        with pytest.raises(ValueError, match=message):
            parse_temperatures(bad)
    with pytest.raises(ValueError, match="top_p must be in"):  # refused before anything is loaded
        main(["--drafter", str(tmp_path / "nowhere"), "--prompts", str(prompts_file), "--top_p", "0"])


def test_first_mismatch():
    assert first_mismatch([1, 2, 3], [1, 2, 3]) is None
    assert first_mismatch([1, 2, 3], [1, 5, 3]) == 1
    assert first_mismatch([1, 2], [1, 2, 3]) == 2


def record(category, accepted, step_tokens, new_tokens, mismatch=None, spec_s=1.0, target_s=1.0, expected=None):
    return {"category": category, "new_tokens": new_tokens, "steps": len(accepted), "accepted_lengths": accepted,
            "step_tokens": step_tokens, "first_mismatch": mismatch, "speculative_seconds": spec_s,
            "target_seconds": target_s, "expected_accepted": expected or [float(a) for a in accepted]}


def test_summary_arithmetic():
    records = [record("a", [0, 3, 1], [1, 4, 2], 8, spec_s=1.0, target_s=3.0), record("b", [3], [4], 5, mismatch=2)]
    r = summarize(records, block_size=4, max_new_tokens=8)
    assert r["tau_pooled"] == (1 + 4 + 2 + 4) / 4 and r["tokens_per_step"] == 13 / 4
    assert r["tau_prompt_mean"] == (7 / 3 + 4) / 2
    assert r["acceptance_histogram"] == [1, 1, 0, 2]
    assert r["slot_acceptance"] == [3 / 4, 2 / 4, 2 / 4]  # P(accepted >= k), k = 1..3
    assert r["speedup"] == 2.0 and r["mismatches"] == 1
    assert r["per_category"]["a"]["tau_pooled"] == 7 / 3 and r["per_category"]["b"]["tau_pooled"] == 4
    assert [p["tau"] for p in r["prompts"]] == [7 / 3, 4] and "tau" not in records[0]  # input left as it was
    assert r["expected_tau_pooled"] == 1 + 7 / 4  # greedy: the accepted counts themselves


def test_expected_tau_and_sampled_mismatches():
    records = [record("a", [0, 3, 1], [1, 4, 2], 8, expected=[0.5, 2.0, 1.0]), record("b", [3], [4], 5,
                                                                                        expected=[2.5])]
    r = summarize(records, block_size=4, max_new_tokens=8, greedy=False)
    assert r["expected_tau_pooled"] == 1 + 6 / 4 and r["per_category"]["a"]["expected_tau_pooled"] == 1 + 3.5 / 3
    assert r["mismatches"] is None  # a sampled run is not compared token for token


STOP = 2
# Hand-made decode traces: the prefill's token, then what each step emitted (a accepted drafts + the bonus token).
TRACES = [
    dict(prefill=5, steps=[[6, 7, 8], [9], [10, STOP, 11, 12]], max_new_tokens=50),  # stop token mid-step
    dict(prefill=5, steps=[[6, 7, 8, 9], [10, 11, 12]], max_new_tokens=6),  # length limit mid-step
    dict(prefill=5, steps=[[6, 7], [8, STOP]], max_new_tokens=50),  # stop token at a step's end
]


def plain_count(trace) -> tuple[list[int], list[int]]:
    """The output as greedy decoding leaves it, and per step how many of its tokens are in that output."""
    stream = [trace["prefill"]] + [t for step in trace["steps"] for t in step]
    end = min(stream.index(STOP) + 1 if STOP in stream else len(stream), trace["max_new_tokens"])
    counts, position = [], 1
    for step in trace["steps"]:
        counts.append(sum(position + i < end for i in range(len(step))))
        position += len(step)
    return stream[:end], counts


def test_tau_counts_only_tokens_up_to_the_stop_token_and_the_length_limit():
    """docs/method.md section 6: the last step of a sequence counts nothing after the stop token or past the limit."""
    records = []
    for trace in TRACES:
        output, counts = plain_count(trace)
        generation = Generation(output, [len(step) - 1 for step in trace["steps"]], len(trace["steps"]))
        assert generation.step_tokens == counts
        records.append(record(None, generation.accepted_lengths, generation.step_tokens, len(generation.tokens)))
    assert [r["step_tokens"] for r in records] == [[3, 1, 2], [4, 1], [2, 2]]  # the plain count, by hand
    report = summarize(records, block_size=4, max_new_tokens=50)
    assert report["tau_pooled"] == (3 + 1 + 2 + 4 + 1 + 2 + 2) / 7
    assert report["tau_prompt_mean"] == (6 / 3 + 5 / 2 + 4 / 2) / 3
    assert [p["tau"] for p in report["prompts"]] == [2, 2.5, 2]
    assert report["acceptance_histogram"] == [1, 2, 2, 2]  # acceptance itself is of the drafts as verified


def test_bad_prompts_file_names_file_and_line(tmp_path):
    from dflash_lightning.decoding.evaluate import read_prompts

    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": \n')
    with pytest.raises(ValueError, match=r"p\.jsonl:2: not a JSON line"):
        read_prompts(path)
    path.write_text('{"prompt": "a"}\n\n{"text": "b"}\n')
    with pytest.raises(ValueError, match=r"p\.jsonl:3: a prompt row needs"):
        read_prompts(path)


class LogRecorder:
    """What spec_eval needs of a trainer and a module, recording what it logs."""

    def __init__(self, drafter) -> None:
        self.drafter, self.device, self.is_global_zero, self.global_step = drafter, torch.device("cpu"), True, 2
        self.logged: dict[str, float] = {}

    def log(self, name, value, **kwargs) -> None:
        self.logged[name] = float(value)


@pytest.mark.parametrize("temperature,names", [
    (0.0, {"val/tau_served", "val/tau_served_prompt_mean", "val/speculative_mismatches"}),
    (0.6, {"val/tau_served_t0.6", "val/tau_expected_t0.6"}),
])
def test_spec_eval_logs_each_temperature_under_its_own_name(tiny_target, prompts_file, temperature, names):
    from dflash_lightning.decoding.validation import SpeculativeValidation

    target = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32)
    cfg = DrafterConfig(num_layers=1, block_size=4, mask_token_id=52, gamma=4.0).resolved(target.config)
    callback = SpeculativeValidation(str(prompts_file), every_n_steps=2, num_prompts=2, max_new_tokens=6,
                                     target=str(tiny_target), dtype="float32", temperature=temperature)
    recorder = LogRecorder(DFlashDrafter(cfg))
    callback.run(recorder, recorder)
    assert set(recorder.logged) == names
    for name, value in recorder.logged.items():  # tau >= 1 by definition; greedy serving is lossless
        assert value == 0 if name.endswith("mismatches") else value >= 1, (name, value)
    with pytest.raises(ValueError, match="top_k"):
        SpeculativeValidation(str(prompts_file), every_n_steps=2, temperature=1.0, top_k=-1)
