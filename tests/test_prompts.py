"""The prompt builder (dflash_lightning/regenerate/prompts/): a small build's counts, determinism, deduplication and
held-out split; the HumanEval reader and overlap check; the committed files against their manifest and HumanEval."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import dflash_lightning
from dflash_lightning.data.conversations import iter_records, resolve_files
from dflash_lightning.regenerate.prompts import build, humaneval, library_api, math_problems
from dflash_lightning.regenerate.prompts.records import dedup_key, sha256_file, user_prompt, write_jsonl_gz

COMMITTED = Path(dflash_lightning.__file__).parent / "assets" / "smollm2" / "prompts"
SMALL = {"python_docs": 60, "library_api": 30, "arithmetic": 60, "word_problems": 60, "code_tasks": 60,
         "self_written": 40, "follow_ups": 40}


@pytest.fixture(scope="module")
def problems() -> list[dict]:
    return humaneval.problems()


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> tuple[Path, dict, Path, dict]:
    """The builder twice on a small subset (two stdlib modules, the first self-written prompts)."""
    seeds = tmp_path_factory.mktemp("seeds") / "self_written.jsonl.gz"
    rows = [{"id": f"self_written:{i}", "text": f"Question number {i} about the sea?"} for i in range(30)]
    write_jsonl_gz(seeds, rows + [{"id": "self_written:dup", "text": "QUESTION number 0  about the sea?"}])
    runs = []
    for name in ("a", "b"):
        out = tmp_path_factory.mktemp(name)
        options = build.Options(counts=dict(SMALL), held_out=5, modules=["json", "textwrap"], self_written=seeds)
        runs += [out, build.build(out, options)]
    return tuple(runs)


def records(path: Path) -> list[dict]:
    return build.read_records(path)


def test_a_small_build_gives_each_source_its_count_and_holds_out_a_tenth(small):
    out, manifest, _, _ = small
    sources = manifest["sources"]
    assert list(sources) == list(SMALL)
    for name, count in SMALL.items():
        kept = sources[name]["train"] + sources[name]["held_out"]
        assert kept == (30 if name == "self_written" else count), name  # 31 seeds, one a repeat
        assert sources[name]["held_out"] == min(5, kept // 10), name
    assert sources["self_written"]["repeats_dropped"] == 1
    train, held = records(out / build.TRAIN), records(out / build.HELD_OUT)
    assert {r["category"] for r in train} == set(SMALL) == {r["category"] for r in held}
    assert all(r["messages"][-1]["role"] == "user" and r["id"] for r in train + held)
    assert manifest["files"][build.TRAIN]["records"] == {n: s["train"] for n, s in sources.items()}


def test_a_small_build_is_the_same_bytes_on_a_rerun(small):
    out_a, manifest_a, out_b, manifest_b = small
    for name in (build.TRAIN, build.HELD_OUT, build.HUMANEVAL):
        assert sha256_file(out_a / name) == sha256_file(out_b / name), name
    assert manifest_a["files"] == manifest_b["files"]


def test_no_two_records_are_the_same_prompt_and_held_out_is_apart_from_train(small):
    out = small[0]
    train, held = records(out / build.TRAIN), records(out / build.HELD_OUT)
    keys = [dedup_key(r["messages"]) for r in train + held]
    assert len(keys) == len(set(keys))
    held_keys = {dedup_key(r["messages"]) for r in held}
    assert not held_keys & {dedup_key(r["messages"]) for r in train}
    # a follow-up starts from a training prompt of another source, never a held-out one
    firsts = [dedup_key(r["messages"][:1]) for r in train + held if r["category"] == "follow_ups"]
    assert firsts and not set(firsts) & held_keys


def test_the_split_is_by_hash_and_the_dedup_ignores_case_and_spaces():
    prompts = [user_prompt(str(i), "x", f"question {i}") for i in range(40)]
    train, held = build.split(prompts, 300)
    assert len(held) == 4 and build.split(prompts[::-1], 300)[1] == held[::-1]  # by hash, not position
    assert dedup_key([{"role": "user", "content": " What IS  2+2?\n"}]) == dedup_key(
        [{"role": "user", "content": "what is 2+2?"}])


def test_an_endless_source_that_repeats_itself_is_an_error_naming_it(problems):
    same = (user_prompt(str(i), "x", "always the same") for i in range(10**6))
    with pytest.raises(ValueError, match="source x: only 1 distinct"):
        build.take(same, 5, "x", set(), humaneval.OverlapIndex.of(problems), endless=True)


def test_a_fix_prompt_holds_a_call_with_one_bug_and_its_answer_the_correct_call():
    items = [i for i in library_api.module_items(["json"]) if i.name == "json.dumps"]
    import random

    bad, good, what = library_api.bugged_call(items[0], library_api.signature(items[0]), random.Random(1))
    assert good.startswith("json.dumps(obj") and bad != good and what


def test_generated_answers_are_right():
    import random

    for prompt in (p for _, p in zip(range(300), math_problems.arithmetic(random.Random(3)), strict=False)):
        text = prompt.messages[0]["content"]
        if text.startswith("Evaluate "):
            assert str(eval(text[9:].split(".")[0])) == prompt.reference  # the expression, integers only


def test_humaneval_reads_its_164_problems_from_the_wheel(problems):
    assert humaneval.data_file().name == "HumanEval.jsonl.gz"
    prompts = humaneval.prompt_records()
    assert len(problems) == len(prompts) == 164
    assert prompts[0].id == "HumanEval/0" and prompts[0].category == "humaneval"
    assert "def has_close_elements(numbers: List[float], threshold: float)" in prompts[0].messages[0]["content"]


@pytest.mark.parametrize("planted", ["copy", "ngram", "def", "signature"])
def test_the_overlap_check_finds_a_planted_humaneval_prompt(problems, planted):
    index = humaneval.OverlapIndex.of(problems)
    row = problems[12]
    text = {"copy": row["prompt"], "ngram": "Please help: " + " ".join(row["prompt"].split()[20:33]) + " thanks",
            "def": f"Write code:\n\ndef {row['entry_point']}(x):\n    pass",
            "signature": "Implement longest(strings: List[str]) -> Optional[str] for me."}[planted]
    assert index.find([{"role": "user", "content": "What is 2 + 2?"}]) is None
    assert row["task_id"] in (index.find([{"role": "user", "content": text}]) or "")


def test_the_committed_files_match_their_manifest():
    manifest = json.loads((COMMITTED / build.MANIFEST).read_text())
    for name, entry in manifest["files"].items():
        assert sha256_file(COMMITTED / name) == entry["sha256"], name
    assert manifest["files"][build.HUMANEVAL]["records"] == {"humaneval": 164}
    for name, counts in manifest["sources"].items():
        assert manifest["files"][build.TRAIN]["records"][name] == counts["train"]
        assert manifest["files"][build.HELD_OUT]["records"][name] == counts["held_out"] > 0
    assert sum(c["train"] + c["held_out"] for c in manifest["sources"].values()) >= 50_000


def test_the_committed_humaneval_prompts_are_the_wheels():
    assert records(COMMITTED / build.HUMANEVAL) == [p.record() for p in humaneval.prompt_records()]


def test_no_committed_training_prompt_overlaps_humaneval(problems):
    index = humaneval.OverlapIndex.of(problems)
    found = [(r["id"], why) for r in records(COMMITTED / build.TRAIN) if (why := index.find(r["messages"]))]
    assert not found, found[:5]


def test_regenerate_and_fit_read_the_gzip_training_file():
    path = COMMITTED / build.TRAIN
    assert resolve_files([str(path)], "input_files") == [path]
    location, record = next(iter_records(path))
    assert location == f"{path}:1" and record["messages"][-1]["role"] == "user"


def test_the_held_out_prompts_take_the_sources_in_turn():
    """The first N held-out prompts (evaluate --num_prompts, spec_eval) span every source, not the first one alone."""
    categories = [json.loads(line)["category"] for line in (COMMITTED / build.HELD_OUT).read_text().splitlines()]
    sources = list(dict.fromkeys(categories))
    assert len(sources) == 7 and categories[:7] == sources and categories[7:14] == sources
    assert build.interleave([[1, 2, 3], [4], [5, 6]]) == [1, 4, 5, 2, 6, 3]
