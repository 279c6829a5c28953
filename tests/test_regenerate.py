"""regenerate: the target's own greedy answers turn by turn, source order, extra keys kept, and a resume after a
kill (with a torn last line) that neither duplicates nor loses a record."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from conftest import make_target
from helpers import assistant, user, write_jsonl
from transformers import AutoModelForCausalLM, AutoTokenizer

import dflash_lightning.regenerate.generate as rg
from dflash_lightning.commands.cli import cli_main

NEW = 10  # max_new_tokens



@pytest.fixture(scope="module")
def setup(tmp_path_factory, one_thread) -> dict:
    """A tiny target and 9 source lines: one-turn, two-turn, ShareGPT, prompt-only records, and one bad line."""
    root = tmp_path_factory.mktemp("rg")
    target = make_target(root / "target", layers=2, hidden=32, heads=2, kv_heads=1, initializer_range=0.2)
    records = [
        {"messages": [user("what does the function return ?"), assistant("a list .")], "category": "code"},
        {"messages": [user("explain a list ?"), assistant("it is ."), user("and a string ?"), assistant("no .")]},
        {"conversations": [{"from": "system", "value": "be a python module ."},
                           {"from": "human", "value": "what is a file ?"}, {"from": "gpt", "value": "an object ."}]},
        {"messages": [user("is it a number ?")], "category": "prompt-only"},
        *[{"messages": [user(f"the {w} of a class ?"), assistant("the value .")], "id": k}
          for k, w in enumerate(["value", "module", "string", "object"])],
    ]
    path = write_jsonl(root / "in.jsonl", records, bad_line_at=5)  # source index 5: a bad line, skipped
    return {"root": root, "target": str(target), "input": str(path)}


def run(setup: dict, out: Path, **overrides) -> list[dict]:
    kwargs = dict(input_files=[setup["input"]], out=str(out), target=setup["target"], max_new_tokens=NEW,
                  batch_size=2, device="cpu", dtype="float32", on_bad_record="skip", progress=False)
    rg.regenerate(**(kwargs | overrides))
    return [json.loads(line) for line in out.read_text().splitlines()]


def greedy(setup: dict, messages: list[dict]) -> str:
    """The target's greedy answer by plain `model.generate` on one unpadded prompt."""
    tok = AutoTokenizer.from_pretrained(setup["target"])
    model = AutoModelForCausalLM.from_pretrained(setup["target"], dtype=torch.float32).eval()
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id)[0, ids.shape[1]:].tolist()
    if tok.eos_token_id in out:
        out = out[: out.index(tok.eos_token_id)]
    return tok.decode(out, skip_special_tokens=True)


@pytest.fixture(scope="module")
def reference(setup) -> tuple[Path, list[dict]]:
    out = setup["root"] / "reference.jsonl"
    return out, run(setup, out)


def test_answers_are_the_targets_greedy_turns_in_source_order(setup, reference):
    _, rows = reference
    assert [r["source_index"] for r in rows] == [0, 1, 2, 3, 4, 6, 7, 8]  # 5 was the bad line
    assert rows[0]["category"] == "code" and rows[3]["category"] == "prompt-only" and rows[4]["id"] == 0
    assert all(set(r) - {"category", "id"} == {"messages", "source_index"} for r in rows)  # ShareGPT -> messages
    one, two, sharegpt, prompt_only = (r["messages"] for r in rows[:4])
    assert one[1] == assistant(greedy(setup, one[:1]))
    # multi-turn: the second answer continues the conversation whose first answer was already regenerated
    assert two[0] == user("explain a list ?") and two[2] == user("and a string ?")
    assert two[1] == assistant(greedy(setup, two[:1])) and two[3] == assistant(greedy(setup, two[:3]))
    assert two[3] != assistant(greedy(setup, [two[0], assistant("it is ."), two[2]]))  # not the human's turn 1
    assert [m["role"] for m in sharegpt] == ["system", "user", "assistant"]
    assert sharegpt[2] == assistant(greedy(setup, sharegpt[:2]))
    assert len(prompt_only) == 2 and prompt_only[1] == assistant(greedy(setup, prompt_only[:1]))
    assert all(m["content"] != "the value ." for r in rows for m in r["messages"])


def test_resume_after_a_kill_with_a_torn_line(setup, reference, tmp_path, monkeypatch):
    ref_path, _ = reference
    out = tmp_path / "out.jsonl"
    real, calls = rg.regenerate_batch, []

    def dies_on_third_batch(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(rg, "regenerate_batch", dies_on_third_batch)
    with pytest.raises(KeyboardInterrupt):
        run(setup, out)
    monkeypatch.setattr(rg, "regenerate_batch", real)
    assert [json.loads(x)["source_index"] for x in out.read_text().splitlines()] == [0, 1, 2, 3]
    with out.open("ab") as f:  # killed in the middle of writing the next batch
        f.write(ref_path.read_bytes().splitlines(keepends=True)[4][:25])
    assert rg.resume_point(out) == 4 and out.read_bytes().endswith(b"\n")
    run(setup, out)
    assert out.read_bytes() == ref_path.read_bytes()
    run(setup, out)  # finished: nothing is appended
    assert out.read_bytes() == ref_path.read_bytes()


def test_sort_window_batches_by_length_and_keeps_source_order(setup, reference, tmp_path, monkeypatch):
    """A window of records batched by prompt length: shorter prompts share a batch, the file is the reference's."""
    ref_path, _ = reference
    real, batches = rg.regenerate_batch, []

    def spy(model, tokenizer, batch, *args, **kwargs):
        first = [next(i for i, m in enumerate(msgs) if m["role"] == "assistant") for msgs in batch]
        batches.append([sum(len(m["content"]) for m in msgs[:i]) for msgs, i in zip(batch, first, strict=True)])
        return real(model, tokenizer, batch, *args, **kwargs)

    monkeypatch.setattr(rg, "regenerate_batch", spy)
    out = tmp_path / "sorted.jsonl"
    run(setup, out, sort_window=4)
    assert out.read_bytes() == ref_path.read_bytes()
    lengths = [n for b in batches for n in b]  # the 8 good records: one window, 4 batches of 2, shortest first
    assert len(batches) == 4 and lengths == sorted(lengths)
    with pytest.raises(ValueError, match="sort_window >= 1"):
        run(setup, tmp_path / "x.jsonl", sort_window=0)


def test_limit_then_continue_through_the_cli(setup, reference, tmp_path, capsys):
    ref_path, _ = reference
    out = tmp_path / "out.jsonl"
    config = tmp_path / "regenerate.yaml"
    config.write_text(yaml.safe_dump({"input_files": [setup["input"]], "out": str(out), "target": setup["target"],
                                      "max_new_tokens": NEW, "batch_size": 2, "device": "cpu", "dtype": "float32",
                                      "on_bad_record": "skip", "progress": False}))
    cli_main(["regenerate", "--config", str(config), "--limit", "4"])
    assert [json.loads(x)["source_index"] for x in out.read_text().splitlines()] == [0, 1, 2, 3]
    cli_main(["regenerate", "--config", str(config)])
    assert out.read_bytes() == ref_path.read_bytes()
    with pytest.raises(ValueError, match="written with max_new_tokens=10, now max_new_tokens=5"):
        cli_main(["regenerate", "--config", str(config), "--max_new_tokens", "5"])
    with pytest.raises(SystemExit):
        cli_main(["regenerate", "--help"])
    assert "Rewrite every assistant turn" in capsys.readouterr().out


def test_sampling_is_reproducible_per_seed(setup, tmp_path):
    a = run(setup, tmp_path / "a.jsonl", temperature=1.0, top_p=0.9, seed=3, limit=4)
    b = run(setup, tmp_path / "b.jsonl", temperature=1.0, top_p=0.9, seed=3, limit=4)
    assert a == b


def test_bad_lines_and_corrupt_output_raise(setup, tmp_path):
    with pytest.raises(ValueError, match=r"in\.jsonl:6: malformed JSON"):
        run(setup, tmp_path / "x.jsonl", on_bad_record="error")
    out = tmp_path / "y.jsonl"
    out.write_text('{"messages": []}\n')
    with pytest.raises(ValueError, match=r"y\.jsonl:1: not a line written by regenerate"):
        rg.resume_point(out)



def test_the_token_count_is_what_each_row_generated_not_its_padding(tmp_path, capsys):
    """One batch whose answers end apart (a stop string, the limit, the end token, twice): the summary's token count
    is the sum of what each prompt generates alone, unpadded; the padding after a stop string is not counted."""
    target, limit, stop = Path(rg.__file__).parents[1] / "assets" / "tiny" / "target_model", 16, ["tuple"]
    lines = (target.parent / "data" / "prompts.jsonl").read_text().splitlines()
    prompts = [json.loads(lines[k])["messages"][:1] for k in (0, 2, 5, 6)]
    source = write_jsonl(tmp_path / "prompts.jsonl", [{"messages": m} for m in prompts])
    rg.regenerate(input_files=[str(source)], out=str(tmp_path / "out.jsonl"), target=str(target), stop=stop,
                  max_new_tokens=limit, batch_size=len(prompts), device="cpu", dtype="float32", progress=False)
    counted = int(capsys.readouterr().out.split(" tokens generated")[0].rsplit(" ", 1)[-1].replace(",", ""))
    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    lengths = []
    for messages in prompts:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
        ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        out = model.generate(ids, max_new_tokens=limit, do_sample=False, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id, stop_strings=stop, tokenizer=tok)
        lengths.append(out.shape[1] - ids.shape[1])
    assert lengths[1] == limit and len(set(lengths)) >= 3  # the rows of the batch really end apart
    assert counted == sum(lengths)
