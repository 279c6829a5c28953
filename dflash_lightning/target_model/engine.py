"""The engine placement: a running vLLM engine computes the target's features (docs/engine.md).

The engine serves the target with vLLM's `extract_hidden_states` speculative method and the project's hidden-states
connector (`dflash_lightning/engine/vllm_connector.py`). Each document of a packed row is one completion request of
its token ids (`max_tokens` 1); the connector writes the document's hidden states to a file whose path the answer
names; `EngineExtractor` reads it, checks it and lays the features out as the in-process target does.

vLLM's auxiliary hidden state `k` is the residual stream entering decoder layer `k`, so the feature of layer id `j`
(the output of layer j, docs/method.md section 1) is vLLM's `j + 1`, and the final normed hidden state is the
target's own final norm applied to vLLM's `L` (the residual stream after the last layer).
"""

from __future__ import annotations

import atexit
import copy
import fcntl
import http.client
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from dflash_lightning.config import ConfigError
from dflash_lightning.errors import first_line
from dflash_lightning.target_model.features import packed_documents
from dflash_lightning.target_model.loading import resolve_model_dir, weight_map

CONNECTOR = "DFlashHiddenStatesConnector"
CONNECTOR_MODULE = "dflash_lightning.engine.vllm_connector"
FORMAT = "dflash-hidden-states/1"  # the connector's file format (metadata "format")
REQUIRED_FLAGS = ("--no-enable-prefix-caching", "--no-enable-chunked-prefill")


class EngineError(RuntimeError):
    """The engine died, hung or answered malformed data past its deadline, or is set up for other features."""


def aux_layer_ids(layer_ids: list[int], num_target_layers: int, final_hidden: bool) -> list[int]:
    """vLLM's `eagle_aux_hidden_state_layer_ids` that give the features of `layer_ids` (and the final state)."""
    return [j + 1 for j in layer_ids] + ([num_target_layers] if final_hidden else [])


def serve_command(model: str, layer_ids: list[int], num_target_layers: int, final_hidden: bool,
                  storage: str = "/dev/shm/dflash-hidden-states", max_model_len: int | None = None) -> list[str]:
    """The `vllm serve` command (as a list) of an engine that serves these features (run with the repository on
    PYTHONPATH, so that vLLM imports the connector)."""
    speculative = {"method": "extract_hidden_states", "num_speculative_tokens": 1, "draft_model_config": {
        "hf_config": {"eagle_aux_hidden_state_layer_ids": aux_layer_ids(layer_ids, num_target_layers, final_hidden)}}}
    transfer = {"kv_connector": CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": storage}}
    length = ["--max-model-len", str(max_model_len)] if max_model_len else []
    return ["vllm", "serve", model, *length, *REQUIRED_FLAGS, "--speculative-config", json.dumps(speculative),
            "--kv-transfer-config", json.dumps(transfer)]


def final_norm(path: str, dtype: torch.dtype) -> nn.Module:
    """The target's own final norm module (its class from transformers, its weight from the checkpoint), alone."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModel

    folder = resolve_model_dir(path)
    config = copy.deepcopy(AutoConfig.from_pretrained(folder))
    text = getattr(config, "text_config", None) or config
    text.num_hidden_layers = 0
    if isinstance(getattr(text, "layer_types", None), list):
        text.layer_types = []
    with torch.device("meta"):
        model = AutoModel.from_config(text)
    norm = getattr(getattr(model, "language_model", model), "norm", None)
    files = weight_map(folder)
    keys = sorted(k for k in files if k.endswith("norm.weight") and ".layers." not in k and "vision" not in k)
    if norm is None or not keys:
        raise ConfigError(f"target.final_hidden: no final norm in {folder}; the engine placement applies it itself")
    with safe_open(folder / files[keys[0]], "pt") as f:
        weight = f.get_tensor(keys[0])
    norm = norm.to_empty(device="cpu").to(dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm.requires_grad_(False).eval()


class _Answer(Exception):
    """An HTTP answer that is not what vLLM's OpenAI server answers: an error status, or a body that is not JSON."""

    def __init__(self, request: str, status: int, body: bytes) -> None:
        self.request, self.status, self.body = request, status, body
        super().__init__(f"{request} answered HTTP {status}: {first_line(body)}")


def _request(url: str, body: dict[str, Any] | None) -> str:
    """A request as an error names it: `GET /v1/models`."""
    return f"{'GET' if body is None else 'POST'} {urllib.parse.urlsplit(url).path}"


def _call(url: str, body: dict[str, Any] | None, timeout: float) -> Any:
    """GET (or POST `body` as JSON) `url`: the answer's JSON; `_Answer` for an error status or a body not JSON."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"content-type": "application/json"})
    name = _request(url, body)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as err:
        status, raw = err.code, err.read()
    if status >= 300:
        raise _Answer(name, status, raw)
    try:
        return json.loads(raw)
    except ValueError:
        raise _Answer(name, status, raw) from None


class EngineClient:
    """One engine's OpenAI-compatible server: its hidden states of one document per request, checked, with
    retries until a deadline."""

    def __init__(self, url: str, aux_ids: list[int], hidden_size: int, request_timeout_s: float = 60.0,
                 deadline_s: float = 300.0, model: str | None = None) -> None:
        self.url, self.aux_ids, self.hidden_size = url.rstrip("/"), list(aux_ids), hidden_size
        self.request_timeout_s, self.deadline_s = request_timeout_s, deadline_s
        self.model, self.max_model_len = model, None

    def connect(self, deadline_s: float | None = None) -> EngineClient:
        """Waits (up to the deadline) for the server to list its model; takes its name and context length."""
        wait = self.deadline_s if deadline_s is None else deadline_s
        deadline = time.monotonic() + wait
        while (last := self.try_connect()) is not None:
            if time.monotonic() > deadline:
                raise EngineError(f"engine {self.url}: not reachable within {wait:.0f} s ({last})")
            time.sleep(1.0)
        return self

    def try_connect(self) -> str | None:
        """One try of `connect`: None once connected, else why not (no answer, or a 5xx: worth another try). An
        engine that answers, but not as vLLM does (not JSON, another error status, no model list), is refused at once
        naming the request and what it answered."""
        try:
            self._models()
            return None
        except _Answer as err:
            if err.status < 500:
                raise EngineError(f"engine {self.url}: {err}, not what vLLM's OpenAI server answers; "
                                  f"{_hint(self.url, err)}") from None
            return str(err)
        except (OSError, http.client.HTTPException) as err:
            return _said(err)

    def _models(self) -> EngineClient:
        url = f"{self.url}/models"
        answer = _call(url, None, self.request_timeout_s)
        models = answer.get("data") if isinstance(answer, dict) else None
        if not isinstance(models, list) or not all(isinstance(m, dict) and "id" in m for m in models):
            raise _Answer(_request(url, None), 200, json.dumps(answer).encode())  # JSON, but no model list
        entry = next((m for m in models if self.model in (None, m["id"])), None)
        if entry is None:
            raise ConfigError(f"target.engine_urls: engine {self.url} serves {[m['id'] for m in models]}, "
                              f"not {self.model!r}")
        self.model, self.max_model_len = entry["id"], entry.get("max_model_len")
        return self

    def hidden_states(self, token_ids: list[int]) -> Tensor:
        """Hidden states `aux_ids` of one document (the engine may extract more).  # [n, len(aux_ids), H]"""
        n = len(token_ids)
        if self.max_model_len is not None and n + 1 > self.max_model_len:
            raise ConfigError(f"target.engine_urls: engine {self.url} has --max-model-len {self.max_model_len}, a "
                              f"document of {n} tokens needs {n + 1} (its tokens and one answer token)")
        deadline, tries, last = time.monotonic() + self.deadline_s, 0, ""
        while True:
            tries += 1
            try:
                return self._once(token_ids)
            except (OSError, http.client.HTTPException, ValueError, KeyError, TypeError, _Malformed, _Answer) as err:
                if isinstance(err, ConfigError):
                    raise
                last = _said(err)
            if time.monotonic() + _backoff(tries) > deadline:
                raise EngineError(f"engine {self.url}: no valid hidden states for a {n}-token document after {tries} "
                                  f"tries in {self.deadline_s:.0f} s (last: {last})")
            time.sleep(_backoff(tries))

    def _once(self, token_ids: list[int]) -> Tensor:
        body = {"model": self.model, "prompt": token_ids, "max_tokens": 1, "temperature": 0.0}
        answer = _call(f"{self.url}/completions", body, self.request_timeout_s)
        params = (answer.get("kv_transfer_params") if isinstance(answer, dict) else None) or {}
        path = params.get("hidden_states_path")
        if not path:
            raise _Malformed(f"an answer without kv_transfer_params.hidden_states_path (is the engine started with "
                             f"--kv-transfer-config naming {CONNECTOR}?)")
        try:
            return self._read(path, token_ids)
        finally:
            for leftover in (path, path + ".lock"):
                try:
                    os.remove(leftover)
                except FileNotFoundError:
                    pass

    def _read(self, path: str, token_ids: list[int]) -> Tensor:
        from safetensors import safe_open

        deadline = time.monotonic() + self.request_timeout_s
        while not (os.path.exists(path) and _unlocked(path + ".lock")):  # the writer holds the lock until it is whole
            if time.monotonic() > deadline:
                raise _Malformed(f"{path} was not written within {self.request_timeout_s:.0f} s")
            time.sleep(0.002)
        with safe_open(path, "pt") as f:
            meta = f.metadata() or {}
            states, ids = f.get_tensor("hidden_states"), f.get_tensor("token_ids")
        if meta.get("format") != FORMAT:
            raise _Malformed(f"{path}: not written by {CONNECTOR} (metadata {meta})")
        served = json.loads(meta.get("aux_layer_ids", "[]"))
        missing = [k for k in self.aux_ids if k not in served]
        if missing:
            raise ConfigError(f"target.engine_urls: engine {self.url} extracts eagle_aux_hidden_state_layer_ids "
                              f"{served}, these features need {self.aux_ids} (missing {missing}): restart it with "
                              "--speculative-config naming them (docs/engine.md)")
        n, k = len(token_ids), len(served)
        if tuple(states.shape) != (n, k, self.hidden_size) or ids.tolist() != list(token_ids):
            raise _Malformed(f"{path}: hidden states {tuple(states.shape)} of {ids.numel()} tokens, expected "
                             f"{(n, k, self.hidden_size)} of the request's {n}")
        states = states[:, [served.index(k) for k in self.aux_ids]]
        if not torch.isfinite(states).all():
            raise _Malformed(f"{path}: non-finite hidden states")
        return states


def _unlocked(lock: str) -> bool:
    """Whether no writer holds `lock` (vLLM's protocol: an exclusive flock until the file is complete)."""
    try:
        fd = os.open(lock, os.O_RDONLY)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


class _Malformed(Exception):
    """An answer that cannot be what was asked for (retried)."""


def _backoff(tries: int) -> float:
    return min(0.25 * 2 ** (tries - 1), 5.0)


def _said(err: BaseException) -> str:
    if isinstance(err, _Answer):
        return str(err)
    return f"{type(err).__name__}: {err}".splitlines()[0][:300]


def _hint(url: str, answer: _Answer) -> str:
    """What to check when an engine's URL answers, but not as vLLM does."""
    if answer.status == 404 and not url.endswith("/v1"):
        return "target.engine_urls names each engine's base URL, ending in /v1 (http://host:port/v1)"
    if answer.status in (401, 403):
        return "the engine asks for an API key, which the trainer does not send: start it without --api-key"
    return "is target.engine_urls the base URL of a vLLM engine (http://host:port/v1)?"


class EngineExtractor:
    """`FeatureExtractor.extract` from an engine: the batch fields of a packed row, each document one request."""

    def __init__(self, client: EngineClient, layer_ids: list[int], dtype: torch.dtype,
                 norm: nn.Module | None = None, concurrency: int = 16) -> None:
        self.client, self.layer_ids, self.dtype, self.norm = client, list(layer_ids), dtype, norm
        self.pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="dflash-engine")
        self.device = torch.device("cpu")

    @torch.no_grad()
    def extract(self, input_ids: Tensor, position_ids: Tensor) -> dict[str, Tensor]:
        """`context_features [T, K*H]` (and `final_hidden [T, H]` with a final norm) of a packed row `[T]`: each
        segment whose positions restart at 0 (the documents, and the padding tail, as the in-process target runs
        it) is one request; all are in flight at once."""
        ids, doc = input_ids.cpu(), packed_documents(position_ids.cpu())
        bounds = torch.nonzero(torch.diff(doc, prepend=doc[:1] - 1)).flatten().tolist() + [ids.numel()]
        segments = [ids[a:b].tolist() for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        states = torch.cat(list(self.pool.map(self.client.hidden_states, segments)))  # [T, K(+1), H]
        k = len(self.layer_ids)
        out = {"context_features": states[:, :k].reshape(states.shape[0], -1).to(self.dtype)}
        if self.norm is not None:
            out["final_hidden"] = self.norm(states[:, k].to(self.dtype))
        return out


def connector_path() -> Path:
    """A new folder that holds only the connector's module under its import name, for the engine's PYTHONPATH (the
    package's folder itself would be site-packages for an installed project, mixing the two venvs)."""
    import shutil
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="dflash-connector-"))
    package = folder / "dflash_lightning" / "engine"
    package.mkdir(parents=True)
    (folder / "dflash_lightning" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    shutil.copy(Path(__file__).resolve().parents[1] / "engine" / "vllm_connector.py", package)
    return folder


class EngineProcess:
    """An engine `fit` starts from `target.engine_command` (a shell command), in its own process group."""

    def __init__(self, command: str, log: Path, env: dict[str, str] | None = None) -> None:
        missing = [flag for flag in REQUIRED_FLAGS if flag not in command]
        if missing:
            raise ConfigError(f"target.engine_command: add {' '.join(missing)} (prefix caching and chunked prefill "
                              "skip tokens whose hidden states the drafter needs)")
        self.command, self.log, self.env, self.process = command, log, dict(env or {}), None
        self.folder: Path | None = None

    def start(self) -> EngineProcess:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.folder = connector_path()
        env = {**os.environ, **self.env, "PYTHONPATH": str(self.folder)}
        with self.log.open("ab") as log:
            log.write(f"$ {self.command}\n".encode())
            self.process = subprocess.Popen(["bash", "-c", self.command], env=env, stdout=log,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True)
        atexit.register(self.stop)  # a run that ends without teardown (a preemption's exit) leaves no engine behind
        return self

    def check_alive(self) -> None:
        if self.process is not None and self.process.poll() is not None:
            tail = self.log.read_text(errors="replace").strip().splitlines()[-1:] if self.log.exists() else []
            raise EngineError(f"target.engine_command exited with {self.process.returncode} (log {self.log}: "
                              f"{tail[0] if tail else 'empty'})")

    def stop(self) -> None:
        """SIGTERM to its process group, SIGKILL after 20 s; the connector's folder is removed."""
        if self.folder is not None:
            import shutil

            shutil.rmtree(self.folder, ignore_errors=True)
        if self.process is None or self.process.poll() is not None:
            return
        for sig, grace in ((signal.SIGTERM, 20), (signal.SIGKILL, 30)):
            try:
                os.killpg(self.process.pid, sig)
                self.process.wait(timeout=grace)
                return
            except ProcessLookupError:
                return
            except subprocess.TimeoutExpired:
                continue


def wait_ready(clients: list[EngineClient], engine: EngineProcess | None, deadline_s: float) -> None:
    """Connects every client, stopping early if the engine `fit` started has exited."""
    deadline = time.monotonic() + deadline_s
    for client in clients:
        while True:
            if engine is not None:
                engine.check_alive()
            last = client.try_connect()
            if last is None:
                break
            if time.monotonic() > deadline:
                raise EngineError(f"engine {client.url}: not reachable within {deadline_s:.0f} s ({last})")
            time.sleep(1.0)
