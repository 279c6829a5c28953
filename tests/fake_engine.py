"""A stand-in for a vLLM engine with the project's hidden-states connector, for the engine placement's fault tests.

It speaks the same protocol (GET /v1/models; POST /v1/completions answering `kv_transfer_params.hidden_states_path`
of a safetensors file the connector would write) with hidden states of a seeded function of the token ids, and
misbehaves on request: `python tests/fake_engine.py PORT DIR HIDDEN AUX_IDS MODE [N]`, MODE one of
ok, die_after (exits after N answers), hang_after (stops answering after N), malformed (wrong shapes),
flaky (every other answer fails with HTTP 500), no_path (answers without the file's path).
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
from safetensors.torch import save_file

FORMAT = "dflash-hidden-states/1"


def states_of(token_ids: list[int], aux: int, hidden: int) -> torch.Tensor:
    """A deterministic `[n, aux, hidden]` function of each token id and its position."""
    ids = torch.tensor(token_ids, dtype=torch.float32)[:, None, None]
    pos = torch.arange(len(token_ids), dtype=torch.float32)[:, None, None]
    grid = torch.arange(aux * hidden, dtype=torch.float32).reshape(1, aux, hidden)
    return torch.sin(ids * 0.01 + pos * 0.1 + grid * 0.001)


def main() -> None:
    port, folder, hidden, aux_ids, mode = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4]), \
        sys.argv[5]
    limit = int(sys.argv[6]) if len(sys.argv) > 6 else 0
    os.makedirs(folder, exist_ok=True)
    count = [0]

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def answer(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                self.answer(200, {})
            else:
                self.answer(200, {"data": [{"id": "fake", "max_model_len": 4096}]})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            count[0] += 1
            with open(os.path.join(os.path.dirname(folder), f"requests-{port}.log"), "a") as log:  # for the DDP test
                log.write("1\n")
            if mode == "die_after" and count[0] > limit:
                os._exit(3)
            if mode == "hang_after" and count[0] > limit:
                time.sleep(3600)
            if mode == "flaky" and count[0] % 2:
                self.answer(500, {"error": "flaky"})
                return
            ids = body["prompt"]
            states = states_of(ids, len(aux_ids), hidden)
            if mode == "malformed":
                states = states[:-1]
            path = os.path.join(folder, f"{uuid.uuid4().hex}.safetensors")
            meta = {"format": FORMAT, "aux_layer_ids": json.dumps(aux_ids), "model": "fake"}
            save_file({"hidden_states": states, "token_ids": torch.tensor(ids)}, path, metadata=meta)
            params = {} if mode == "no_path" else {"hidden_states_path": path}
            self.answer(200, {"choices": [{"text": "x"}], "kv_transfer_params": params})

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    main()
