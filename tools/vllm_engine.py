"""`vllm serve` from the engine venv (tools/engine_venv.sh) on a free loopback port: started in its own process
group, waited for with a deadline, killed and reaped with its children; and vLLM's speculative-decoding counters
read from its /metrics endpoint. Used by tests/test_engine_vllm.py and benchmarks/RESULTS.md's served tau."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ENV_VAR = "DFLASH_ENGINE_PYTHON"
HOST = "127.0.0.1"
STARTUP_S = 420.0  # imports, the engine core's start and the model load on a loaded 2-core machine
# What vLLM's CPU build needs here: a KV cache it can allocate (GiB), and its message queues on the loopback
# address (it would otherwise take the machine's first interface).
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": HOST, "VLLM_LOOPBACK_IP": HOST, "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
# The flags a CPU user adds to the command `export` prints: the tiny target is float32, and the CPU build
# has no CUDA graphs to capture.
CPU_FLAGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "1024"]


class EngineError(RuntimeError):
    """The engine venv is missing or broken, or the server did not come up: one line saying which."""


def engine_python(value: str | None = None) -> Path:
    """The engine venv's python named by $DFLASH_ENGINE_PYTHON (or `value`), checked: vLLM imports there."""
    value = value if value is not None else os.environ.get(ENV_VAR, "")
    if not value:
        raise EngineError(f"no engine venv: set {ENV_VAR} to the python of a venv made by tools/engine_venv.sh")
    python = Path(value)
    if not python.is_file() or not os.access(python, os.X_OK):
        raise EngineError(f"{ENV_VAR}={value}: no such python; make the venv with tools/engine_venv.sh")
    vllm = python.parent / "vllm"
    if not vllm.is_file():
        raise EngineError(f"{ENV_VAR}={value}: no `vllm` command beside it; make the venv with tools/engine_venv.sh")
    done = subprocess.run([str(python), "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"],
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise EngineError(f"{ENV_VAR}={value}: `import vllm` fails ({last}); remake the venv with tools/engine_venv.sh")
    return python


def free_port() -> int:
    """A TCP port free on the loopback address now."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class VllmServer:
    """One `vllm serve MODEL ARGS` on HOST:port; `start`, `wait`, `stop` (also as a context manager)."""

    def __init__(self, python: Path, model: str | Path, args: list[str], log: Path, port: int | None = None,
                 env: dict[str, str] | None = None, cwd: Path | None = None) -> None:
        """`model` as given to `vllm serve` (relative to `cwd`), which is also the served model's name."""
        self.python, self.model, self.args, self.log = python, str(model), list(args), log
        self.port = port or free_port()
        self.env, self.cwd = env or {}, cwd
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """The OpenAI-compatible base URL."""
        return f"http://{HOST}:{self.port}/v1"

    @property
    def command(self) -> list[str]:
        return [str(self.python.parent / "vllm"), "serve", self.model, "--host", HOST, "--port", str(self.port),
                *self.args]

    def start(self) -> VllmServer:
        """Starts the server in a new session (its process group holds the engine core and its workers)."""
        env = {**os.environ, **CPU_ENV, **self.env}
        env.pop("PYTHONPATH", None)  # the project's own modules stay out of the engine venv
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as log:
            log.write(f"$ {' '.join(self.command)}\n".encode())
            self.process = subprocess.Popen(self.command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True, cwd=self.cwd)
        return self

    def wait(self, deadline_s: float = STARTUP_S) -> str:
        """Blocks until /health answers 200 within `deadline_s`; the URL. A server that exits or stays down stops
        the wait with one line naming the log, whose tail follows it."""
        assert self.process is not None, "start() first"
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise EngineError(f"vllm serve exited with {self.process.returncode} before it was ready (log "
                                  f"{self.log})\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"http://{HOST}:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        return self.url
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.5)
        self.stop()
        raise EngineError(f"vllm serve was not ready within {deadline_s:.0f} s (log {self.log})\n{self.tail()}")

    def exited(self, timeout_s: float = STARTUP_S) -> int:
        """Waits for a server expected to refuse its settings to exit; its exit code (the process is reaped)."""
        assert self.process is not None, "start() first"
        try:
            return self.process.wait(timeout=timeout_s)
        finally:
            self.stop()

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def stop(self) -> None:
        """SIGTERM to the whole process group, SIGKILL after 20 s, then reaps the server (children are the group's)."""
        if self.process is None:
            return
        for sig, grace in ((signal.SIGTERM, 20), (signal.SIGKILL, 30)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                continue
            if not _group_alive(self.process.pid):
                break
        if self.process.poll() is None:
            self.process.wait(timeout=30)
        _wait_group_gone(self.process.pid)  # the engine core and its workers too

    def kill(self) -> None:
        """SIGKILL to the whole group at once (a crash, not a shutdown), reaped."""
        if self.process is not None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait(timeout=30)
            _wait_group_gone(self.process.pid)

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_group_gone(pgid: int, timeout_s: float = 30.0) -> None:
    """Waits until no process of group `pgid` is left (children of the reaped leader are re-parented and reaped by
    init; a zombie left to this process is reaped here)."""
    deadline = time.monotonic() + timeout_s
    while _group_alive(pgid) and time.monotonic() < deadline:
        try:
            os.waitpid(-pgid, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.1)


SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts_total": "drafts",
    "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens_total": "accepted_tokens",
}
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


def spec_decode_counters(url: str) -> dict[str, Any]:
    """vLLM's speculative-decoding counters from the server's /metrics (Prometheus text): drafts (verification
    steps with drafts), draft_tokens, accepted_tokens and accepted_per_position (steps whose position k, 0-based,
    was accepted)."""
    with urllib.request.urlopen(url.removesuffix("/v1") + "/metrics", timeout=30) as r:
        text = r.read().decode()
    counts: dict[str, Any] = {name: 0 for name in SPEC_COUNTERS.values()}
    positions: dict[int, int] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        metric, _, value = line.rpartition(" ")
        name = metric.split("{", 1)[0]
        if name in SPEC_COUNTERS:
            counts[SPEC_COUNTERS[name]] += int(float(value))
        elif name == PER_POSITION:
            position = int(re.search(r'position="(\d+)"', metric)[1])
            positions[position] = positions.get(position, 0) + int(float(value))
    counts["accepted_per_position"] = [positions.get(k, 0) for k in range(max(positions, default=-1) + 1)]
    return counts


def post_json(url: str, body: dict[str, Any], timeout: float = 600.0) -> dict[str, Any]:
    """POST a JSON body, the JSON answer (an HTTP error raises with the server's message)."""
    request = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as err:
        raise RuntimeError(f"{url}: HTTP {err.code}: {err.read().decode(errors='replace')[:2000]}") from None
