"""Every setting a user types is checked before any target work (issue 46): a value outside its range is refused in one
line naming the field and the range, and a value nothing would read (a part's setting under a variant without the
part, an engine setting under another placement) in one line naming the setting and where it is read.

The module is built on a target path that does not exist: a check that let a value through would end in 'no model
folder' (FileNotFoundError), not in the ConfigError asserted.
"""

from __future__ import annotations

import json
import math
import threading
from dataclasses import fields, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from dflash_lightning.__main__ import FAILED_RUN
from dflash_lightning.commands.cli import cli_main
from dflash_lightning.config import ConfigError, DrafterConfig, check_unused_parts
from dflash_lightning.decoding.validation import SpeculativeValidation
from dflash_lightning.module import DFlashModule
from dflash_lightning.parts.presets import ALL_PARTS, PRESETS
from dflash_lightning.target_model import TargetFeatures
from dflash_lightning.target_model.callback import check_target_settings
from dflash_lightning.target_model.engine import EngineClient, EngineError, wait_ready

CONFIGS = Path(__file__).parents[1] / "configs"
NO_TARGET = "/nonexistent/target"


def refused(drafter: DrafterConfig | None = None, target: str = NO_TARGET, **module) -> str:
    """The one line DFlashModule refuses these settings with."""
    with pytest.raises(ConfigError) as err:
        DFlashModule(target, drafter or DrafterConfig(), **{"token_budget": 64, "num_anchors": 8, **module})
    assert "\n" not in str(err.value)
    return str(err.value)


def with_part(part, **values) -> DrafterConfig:
    """A drafter of the first variant that has `part`, its settings changed by `values`."""
    variant = next(v for v, p in PRESETS.items() if part in p.parts)
    return DrafterConfig(variant=variant, block_size=8, **{part.name: replace(part.settings_type(), **values)})


# ---------------------------------------------------------------------------------------- each part's fields

BAD = {  # (part, field) -> (a value its part refuses, the line's start); None: no bad value (a bool, typed by the CLI)
    ("conv", "kernel_size"): (0, "conv.kernel_size must be in 1..block_size (8), got 0"),
    ("conv", "group_size"): (0, "conv.group_size must be >= 1 and divide hidden_size, got 0"),
    ("selector", "rank"): (0, "selector.rank must be >= 1, got 0"),
    ("selector", "top_k"): (1, "selector.top_k must be in 2..vocab_size, got 1"),
    ("selector", "loss_weight"): (-1.0, "selector.loss_weight must be >= 0, got -1.0"),
    ("lilicorr", "candidate_topk"): (3, "lilicorr.candidate_topk must be a power of two in 1..16 (the engines'), "
                                        "got 3"),
    ("lilicorr", "hidden_size"): (-1, "lilicorr.hidden_size must be >= 0 (0: the drafter's width), got -1"),
    ("lilicorr", "factor_dim"): (0, "lilicorr.factor_dim must be >= 1, got 0"),
    ("lilicorr", "num_layers"): (0, "lilicorr.num_layers must be >= 1, got 0"),
    ("lilicorr", "num_heads"): (0, "lilicorr.num_heads must be >= 1, got 0"),
    ("lilicorr", "mlp_ratio"): (1e-4, "lilicorr.mlp_ratio must be >= 1/Hh = 0.0009766 (Hh 1024: a lattice MLP of at "
                                      "least one unit), got 0.0001"),
    ("lilicorr", "logit_scale"): (0.0, "lilicorr.logit_scale must be > 0, got 0.0"),
    ("lilicorr", "vector_eps"): (0.5, "lilicorr.vector_eps must be in (0, 0.5), got 0.5"),
    ("lilicorr", "ce_weight"): (-1.0, "lilicorr.ce_weight must be >= 0, got -1.0"),
    ("lilicorr", "margin_weight"): (-1.0, "lilicorr.margin_weight must be >= 0, got -1.0"),
    ("lilicorr", "penalty_weight"): (-1.0, "lilicorr.penalty_weight must be >= 0, got -1.0"),
    ("lilicorr", "token_proj_std"): (0.0, "lilicorr.token_proj_std must be > 0 and finite (None: 0.02), got 0.0"),
    ("dspark_heads", "markov_rank"): (0, "dspark_heads.markov_rank must be >= 1, got 0"),
    ("dspark_heads", "confidence_with_markov"): None,
    ("dspark_heads", "ce_weight"): (-1.0, "dspark_heads.ce_weight must be >= 0, got -1.0"),
    ("dspark_heads", "tv_weight"): (-1.0, "dspark_heads.tv_weight must be >= 0, got -1.0"),
    ("dspark_heads", "confidence_weight"): (-1.0, "dspark_heads.confidence_weight must be >= 0, got -1.0"),
    ("xpress", "rank"): (48, "xpress.rank must be a power of two >= 16 (vLLM's Jacobi kernel), got 48"),
    ("xpress", "mlp_hidden"): (96, "xpress.mlp_hidden must be a multiple of 64 (vLLM's Jacobi kernel), got 96"),
    ("xpress", "num_passes"): (0, "xpress.num_passes must be >= 1, got 0"),
    ("xpress", "topc"): (-1, "xpress.topc must be in 0..vocab_size (0: the full vocabulary), got -1"),
    ("xpress", "sampled_drafts"): None,
    ("xpress", "consistency_rounds"): (-1, "xpress.consistency_rounds must be >= 0, got -1"),
    ("xpress", "consistency_weight"): (-1.0, "xpress.consistency_weight must be >= 0, got -1.0"),
    ("xpress", "base_weight"): (-1.0, "xpress.base_weight must be >= 0, got -1.0"),
    ("xpress", "ce_weight"): (-1.0, "xpress.ce_weight must be >= 0, got -1.0"),
    ("xpress", "tv_weight"): (-1.0, "xpress.tv_weight must be >= 0, got -1.0"),
    ("xpress", "prev0"): ("before", "xpress.prev0 must be 'previous' or 'anchor', got 'before'"),
    ("domino", "gru_hidden_dim"): (0, "domino.gru_hidden_dim must be an integer >= 1, got 0"),
    ("domino", "emb_dim"): (0, "domino.emb_dim must be an integer >= 1, got 0"),
    ("domino", "pure_draft_prefix_len"): (2, "domino.pure_draft_prefix_len must be 1 (SGLang 0.5.23, the one engine "
                                             "that serves Domino, refuses other values), got 2"),
    ("domino", "lambda_base_start"): (1.5, "domino.lambda_base_start must be in [0, 1] (0: no curriculum), got 1.5"),
    ("domino", "lambda_base_decay_ratio"): (0.0, "domino.lambda_base_decay_ratio must be in (0, 1] (a fraction of the "
                                                 "run's steps), got 0.0"),
    ("domino", "candidate_pool_size"): (-1, "domino.candidate_pool_size must be an integer >= 0 (0: the full "
                                            "vocabulary), got -1"),
}


def test_every_field_of_every_part_is_refused_out_of_range_before_the_target_is_read():
    """Each field's bad value, and inf and NaN for each number (the rule is the config's, for any part), refused in
    one line naming the field; a part's field without a row here fails the test."""
    every = [(part, f) for part in ALL_PARTS for f in fields(part.settings_type)]
    assert {(part.name, f.name) for part, f in every} == set(BAD), "a part's field has no bad value in BAD"
    for part, f in every:
        case = BAD[part.name, f.name]
        if case is not None:
            assert refused(with_part(part, **{f.name: case[0]})) == case[1]
        if f.type == "float":
            for value in (math.inf, math.nan):
                assert refused(with_part(part, **{f.name: value})) == \
                    f"{part.name}.{f.name} must be a finite number, got {value}"


def test_settings_that_together_cannot_train_are_refused(tiny_target):
    (conv, selector, lilicorr, dspark) = (next(p for p in ALL_PARTS if p.name == n)
                                          for n in ("conv", "selector", "lilicorr", "dspark_heads"))
    assert refused(with_part(lilicorr, ce_weight=0.0, penalty_weight=0.0)).startswith(
        "lilicorr: ce_weight, margin_weight and penalty_weight are all 0, so the reranker would never train")
    assert refused(with_part(dspark, ce_weight=0.0, tv_weight=0.0)) == (
        "dspark_heads: ce_weight and tv_weight are both 0, so the drafter's tokens would never train (only the "
        "confidence head would); set one above 0")
    # a lattice MLP of 0 units at the lattice width (the mlp_ratio 0.01 at width 32)
    assert refused(with_part(lilicorr, hidden_size=32, num_heads=2, mlp_ratio=0.01)).startswith(
        "lilicorr.mlp_ratio must be >= 1/Hh = 0.03125 (Hh 32")
    # what the target decides (width 64, 80 tokens), checked once its config is read
    assert refused(with_part(lilicorr, hidden_size=0, num_heads=2, mlp_ratio=0.01), str(tiny_target)).startswith(
        "lilicorr.mlp_ratio must be >= 1/Hh = 0.01562 (Hh 64")
    assert refused(with_part(conv, group_size=24), str(tiny_target)) == \
        "conv.group_size (24) must divide hidden_size (64)"
    assert refused(with_part(selector, top_k=100), str(tiny_target)).startswith(
        "selector.top_k must be in 2..vocab_size (")
    assert refused(DrafterConfig(block_size=8), str(tiny_target), topk=(1, 1000)).startswith(
        "model.topk: each k must be in 1..vocab_size (")
    xpress = next(p for p in ALL_PARTS if p.name == "xpress")
    assert refused(with_part(xpress, ce_weight=0.0, tv_weight=0.0)) == (
        "xpress: ce_weight and tv_weight are both 0, so nothing would train; set one above 0")
    assert refused(with_part(xpress, topc=1000), str(tiny_target), loss_weights="decay") == (
        "xpress.topc must be in 0..vocab_size (60) (0: the full vocabulary), got 1000")


# ---------------------------------------------------------------------------- a part the variant does not have

def test_a_part_setting_under_a_variant_without_the_part_is_refused_naming_the_variants_with_it():
    """The issue's three cases word for word, then every part under every preset that lacks it (a new part is
    covered without a new line here)."""
    (conv, lilicorr, dspark) = (next(p for p in ALL_PARTS if p.name == n) for n in ("conv", "lilicorr", "dspark_heads"))
    assert refused(replace(with_part(lilicorr, candidate_topk=3), variant="dflash2")) == (
        "model.drafter.lilicorr.candidate_topk=3: variant 'dflash2' has no lilicorr part, so it would be ignored; the "
        "variants with it: lilicorr, lilicorr-conv. Set model.drafter.variant to one of those, or drop the setting "
        "from the config and command line (or override with the default: model.drafter.lilicorr.candidate_topk=8)")
    assert refused(replace(with_part(conv, group_size=8), variant="dspark")).startswith(
        "model.drafter.conv.group_size=8: variant 'dspark' has no conv part, so it would be ignored; the variants "
        "with it: dflash2, lilicorr-conv.")
    assert refused(replace(with_part(dspark, markov_rank=0), variant="lilicorr-conv")).startswith(
        "model.drafter.dspark_heads.markov_rank=0: variant 'lilicorr-conv' has no dspark_heads part, so it would be "
        "ignored; the variants with it: dspark.")
    for part in ALL_PARTS:
        users = ", ".join(v for v, p in PRESETS.items() if part in p.parts)
        for variant in (v for v, p in PRESETS.items() if part not in p.parts):
            for f in fields(part.settings_type):
                other = {"bool": lambda x: not x, "int": lambda x: x + 1}.get(
                    f.type, lambda x: 1.0 if x is None else x + "_" if isinstance(x, str) else x * 2 + 1)  # None: unset
                value = other(getattr(part.settings_type(), f.name))
                cfg = DrafterConfig(variant=variant, **{part.name: replace(part.settings_type(), **{f.name: value})})
                with pytest.raises(ConfigError) as err:
                    check_unused_parts(cfg)
                assert str(err.value).startswith(
                    f"model.drafter.{part.name}.{f.name}={value}: variant '{variant}' has no {part.name} part, so it "
                    f"would be ignored; the variants with it: {users}."), err.value


def test_every_shipped_config_takes_any_variant_and_a_changed_setting_says_what_to_do(tmp_path, monkeypatch):
    """A setting counts as given when it differs from its default: the shipped configs give their parts' defaults, so
    `--model.drafter.variant=<any>` on any of them is not refused. A config that gives another recipe (LiLiCorr's
    'margin' weights) and a variant override is refused through the CLI before the target is read."""
    for path in sorted(CONFIGS.glob("*.yaml")):
        drafter = DrafterConfig.from_dict(yaml.safe_load(path.read_text())["model"]["drafter"])
        for variant in PRESETS:
            check_unused_parts(replace(drafter, variant=variant))
    import dflash_lightning.module as module

    monkeypatch.setattr(module, "load_target_config", lambda *a: pytest.fail("the target was read"))
    config = yaml.safe_load((CONFIGS / "tiny.yaml").read_text())
    config["model"]["drafter"].update(variant="lilicorr", lilicorr={"ce_weight": 0.125, "margin_weight": 0.125})
    (tmp_path / "margin.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError) as err:
        cli_main(["--config", str(tmp_path / "margin.yaml"), "--model.drafter.variant=dflash"], run=False)
    assert str(err.value) == (
        "model.drafter.lilicorr.ce_weight=0.125, model.drafter.lilicorr.margin_weight=0.125: variant 'dflash' has no "
        "lilicorr part, so they would be ignored; the variants with it: lilicorr, lilicorr-conv. Set "
        "model.drafter.variant to one of those, or drop the settings from the config and command line (or override "
        "with the default: model.drafter.lilicorr.ce_weight=0.25, model.drafter.lilicorr.margin_weight=0.0)")


# ------------------------------------------------------------------------------------- the module's own numbers

@pytest.mark.parametrize(("values", "line"), [
    ({"lr": 0.0}, "model.lr must be a finite number > 0, got 0.0"),
    ({"lr": math.nan}, "model.lr must be a finite number > 0, got nan"),
    ({"weight_decay": -0.1}, "model.weight_decay must be a finite number >= 0, got -0.1"),
    ({"betas": (0.9, 1.0)}, "model.betas must be two numbers in [0, 1), got [0.9, 1.0]"),
    ({"compile_mode": "fast"}, "model.compile_mode must be null or one of ('default', 'reduce-overhead', "
                               "'max-autotune', 'max-autotune-no-cudagraphs'), got 'fast'"),
    ({"topk": (5, 10)}, "model.topk must include 1 (plain accuracy) and hold k >= 1 only, got [5, 10]"),
    ({"topk": (1, 0)}, "model.topk must include 1 (plain accuracy) and hold k >= 1 only, got [1, 0]"),
    ({"temperature": math.inf}, "model.temperature must be > 0 and finite, got inf"),
    ({"loss_weights": "decay", "dpace_alpha": 0.3},
     "model.dpace_alpha=0.3: read only with model.loss_weights=dpace, so ignored; set that, or drop model.dpace_alpha"),
    ({"objective": "ce", "temperature": 2.0},
     "model.temperature=2.0: read only with model.objective=kl or ce+kl, so ignored; set that, or drop "
     "model.temperature"),
])
def test_module_numbers_are_refused_naming_the_field(values, line):
    assert refused(**values) == line


def test_each_settings_group_checks_itself_naming_the_full_setting():
    """A group refuses its own bad value without the module, naming `model.<field>` as the CLI spells it."""
    from dflash_lightning.long_runs.nonfinite import NonFiniteSettings
    from dflash_lightning.module_settings import MetricSettings, OptimizerSettings, StepSettings

    for make, line in (
        (lambda: OptimizerSettings(0.0, 0.0, (0.9, 0.95), 0.0, 0.0), "model.lr must be a finite number > 0, got 0.0"),
        (lambda: StepSettings(16, 8, 1, 1), "model.token_budget (8) must be >= block_size (16)"),
        (lambda: MetricSettings(0, (1,)), "model.metrics_every must be >= 1, got 0"),
        (lambda: NonFiniteSettings("skip", 0), "model.max_nonfinite_in_a_row must be >= 1, got 0"),
        (lambda: NonFiniteSettings("ignore", 16), "model.nonfinite must be skip or stop, got 'ignore'"),
    ):
        with pytest.raises(ConfigError) as err:
            make()
        assert str(err.value) == line


def test_every_module_argument_has_its_help_once_in_a_settings_group():
    """The CLI's help of each `--model.*` argument is written once, in its group's docstring (module_settings.py)."""
    import inspect
    import re

    from dflash_lightning.module_settings import ARGS_HELP

    arguments = [name for name in inspect.signature(DFlashModule.__init__).parameters if name != "self"]
    assert sorted(re.findall(r"^    (\w+): \S", ARGS_HELP, re.MULTILINE)) == sorted(arguments)
    assert DFlashModule.__init__.__doc__ == ARGS_HELP


def test_spec_eval_numbers_are_refused_naming_the_field():
    for values, line in (
        ({"every_n_steps": -1}, "spec_eval.every_n_steps must be >= 0 (0: off), got -1"),
        ({"num_prompts": 0}, "spec_eval.num_prompts must be >= 1, got 0"),
        ({"max_new_tokens": 0}, "spec_eval.max_new_tokens must be >= 1, got 0"),
        ({"temperature": math.inf}, "spec_eval.temperature must be finite, got inf"),
        ({"top_p": 0.0}, "spec_eval.top_p must be in (0, 1] (1: off), got 0.0"),
    ):
        with pytest.raises(ConfigError) as err:
            SpeculativeValidation(**values)
        assert str(err.value) == line


# ------------------------------------------------------------------------------------------ engine placement

ENGINE = {"placement": "engine", "engine_urls": ["http://127.0.0.1:8000/v1"]}


@pytest.mark.parametrize(("values", "line"), [
    ({"engine_request_timeout_s": 0}, "target.engine_request_timeout_s must be a finite number of seconds > 0, got 0"),
    ({"engine_request_timeout_s": -1}, "target.engine_request_timeout_s must be a finite number of seconds > 0, "
                                       "got -1"),
    ({"engine_deadline_s": -5}, "target.engine_deadline_s must be a finite number of seconds > 0, got -5"),
    ({"engine_startup_s": -1}, "target.engine_startup_s must be a finite number of seconds > 0, got -1"),
    ({"engine_startup_s": math.inf}, "target.engine_startup_s must be a finite number of seconds > 0, got inf"),
    ({"engine_streams": 0}, "target.engine_streams must be >= 1, got 0"),
    ({"prefetch": 0}, "target.prefetch must be >= 1, got 0"),
    ({"engine_urls": ["127.0.0.1:8000/v1"]}, "target.engine_urls: '127.0.0.1:8000/v1' is not an http(s) URL with a "
                                             "host; give each engine's OpenAI base URL, http://host:port/v1"),
    ({"engine_urls": ["localhost:8000/v1"]}, "target.engine_urls: 'localhost:8000/v1' is not an http(s) URL"),
    ({"engine_urls": ["http://host:port/v1"]}, "target.engine_urls: 'http://host:port/v1' is not an http(s) URL"),
    ({"engine_urls": ["http:///v1"]}, "target.engine_urls: 'http:///v1' is not an http(s) URL"),
    ({"placement": "colocated", "engine_urls": None, "engine_deadline_s": 60.0},
     "target.engine_deadline_s: used by placement 'engine' only, placement is 'colocated', so ignored; add "
     "--target.placement=engine, or drop it"),
    ({"placement": "sharded", "engine_urls": None, "target_devices": ["cuda:1"]},
     "target.target_devices: used by placement 'separate' only, placement is 'sharded', so ignored; add "
     "--target.placement=separate, or drop it"),
    ({"placement": "colocated", "engine_urls": None, "prefetch": 4},
     "target.prefetch: used by placement 'separate' or 'engine' only, placement is 'colocated', so ignored; add "
     "--target.placement=engine, or drop it"),
    ({"feature_cache": "cache/"}, "target.placement=engine: data.feature_cache cache/ serves stored features, no "
                                  "target runs; drop --target.placement (or the feature cache)"),
])
def test_engine_placement_values_are_refused_naming_the_field(values, line):
    with pytest.raises(ConfigError) as err:
        check_target_settings(path="t", **{**ENGINE, **values})
    assert str(err.value).startswith(line) and "\n" not in str(err.value)


def test_the_cli_refuses_a_target_setting_before_the_model_reads_the_target(monkeypatch):
    import dflash_lightning.module as module

    monkeypatch.setattr(module, "load_target_config", lambda *a: pytest.fail("the target was read"))
    with pytest.raises(ConfigError, match=r"^target.engine_urls: '127.0.0.1:9/v1' is not an http\(s\) URL"):
        cli_main(["--config", str(CONFIGS / "tiny.yaml"), "--target.placement=engine",
                  "--target.engine_urls=[127.0.0.1:9/v1]"], run=False)
    with pytest.raises(ConfigError, match="target.engine_request_timeout_s must be"):  # the callback, built alone
        TargetFeatures("t", **ENGINE, engine_request_timeout_s=0)


# ------------------------------------------------------------------ an engine that answers, but not as vLLM does

@pytest.fixture
def answering():
    """An HTTP server on a free port answering every request with `answers[path]` = (status, content type, body);
    yields (base URL, answers)."""
    answers: dict[str, tuple[int, str, bytes]] = {}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def reply(self) -> None:
            if "content-length" in self.headers:
                self.rfile.read(int(self.headers["content-length"]))
            status, kind, body = answers.get(self.path, (404, "application/json", b'{"detail":"Not Found"}'))
            self.send_response(status)
            self.send_header("content-type", kind)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = reply

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", answers
    server.shutdown()
    thread.join()


def test_an_engine_that_answers_not_as_vllm_is_named_with_what_it_answered(answering):
    """Refused at once (not after the startup wait), exit 1 (EngineError); a 5xx is retried and named when the wait
    ends; a completion answered with bytes that are not JSON is retried and named the same way."""
    base, answers = answering
    assert EngineError in FAILED_RUN  # `python -m dflash_lightning` exits 1 on it
    answers["/v1/models"] = (200, "text/html", b"<html><body>It works!</body></html>\n<p>more</p>")
    with pytest.raises(EngineError) as err:
        wait_ready([EngineClient(f"{base}/v1", [1], 16)], None, 30.0)
    assert str(err.value) == (
        f"engine {base}/v1: GET /v1/models answered HTTP 200: '<html><body>It works!</body></html>' ..., not "
        "what vLLM's OpenAI server answers; is target.engine_urls the base URL of a vLLM engine (http://host:port/v1)?")
    with pytest.raises(EngineError) as err:  # the URL without /v1: vLLM's own 404
        wait_ready([EngineClient(base, [1], 16)], None, 30.0)
    assert str(err.value) == (
        f"engine {base}: GET /models answered HTTP 404: '{{\"detail\":\"Not Found\"}}', not what vLLM's "
        "OpenAI server answers; target.engine_urls names each engine's base URL, ending in /v1 (http://host:port/v1)")
    answers["/v1/models"] = (200, "application/json", b'{"object": "list"}')
    with pytest.raises(EngineError, match=r"GET /v1/models answered HTTP 200: '\{\"object\": \"list\"\}'"):
        EngineClient(f"{base}/v1", [1], 16).connect()
    answers["/v1/models"] = (503, "text/plain", b"starting")
    with pytest.raises(EngineError) as err:
        wait_ready([EngineClient(f"{base}/v1", [1], 16)], None, 1.0)
    assert str(err.value) == f"engine {base}/v1: not reachable within 1 s (GET /v1/models answered HTTP 503: " \
                             "'starting')"
    answers["/v1/models"] = (200, "application/json", json.dumps({"data": [{"id": "m"}]}).encode())
    answers["/v1/completions"] = (200, "text/plain", b"Internal error")
    client = EngineClient(f"{base}/v1", [1], 16, deadline_s=0.2).connect()
    with pytest.raises(EngineError) as err:
        client.hidden_states([5, 6])
    assert str(err.value).startswith(f"engine {base}/v1: no valid hidden states for a 2-token document after ")
    assert str(err.value).endswith("(last: POST /v1/completions answered HTTP 200: 'Internal error')")
