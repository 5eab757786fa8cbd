"""`python -m server` as a user runs it: flags, environment variables, and a clean exit on SIGTERM."""

from __future__ import annotations

import json
import os
import signal

import httpx
from httpx_sse import connect_sse

from bench.common import free_port
from tests.server_harness import start_subprocess


def test_cli_serves_then_exits_zero_on_sigterm_mid_stream(model_dir):
    port = free_port()
    env = dict(os.environ, KVSERVE_MAX_BATCH_SIZE="2", KVSERVE_DTYPE="float32",
               KVSERVE_COMPILE="off")  # settings from the environment
    process, lines = start_subprocess("--model", str(model_dir("long")), "--port", str(port), "--device", "cpu",
                                      "--max-seq-len", "4096", env=env)
    try:
        assert any("ready: 2 slots x 4096 tokens" in line for line in lines), "".join(lines)
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{url}/health").json() == {"status": "ok"}
        body = {"prompt": "hi", "stream": True, "max_tokens": 4000, "ignore_eos": True}
        with httpx.Client(base_url=url, timeout=60) as client, connect_sse(client, "POST", "/v1/completions", json=body) as source:
            events = source.iter_sse()
            assert json.loads(next(events).data)["object"] == "text_completion"
            process.send_signal(signal.SIGTERM)
            rest = [e.data for e in events]  # the server ends the stream itself
        assert rest[-1] == "[DONE]"
        assert "shutting down" in rest[-2]
        assert process.wait(60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


# The server as `python -m server` runs it, with one fault injected into its engine loop thread: bookkeeping
# outside any engine step raises once a request has 3 tokens, as a bug there would.
FAULTY_SERVER = """
import sys
from server import __main__ as server_main
from server.runner import EngineRunner

publish = EngineRunner._update_snapshot

def faulty(self):
    publish(self)
    if any(len(r.output_ids) >= 3 for r in self.engine.requests.values()):
        raise RuntimeError("injected fault")

EngineRunner._update_snapshot = faulty
sys.exit(server_main.main(sys.argv[1:]))
"""


def test_a_dead_engine_loop_ends_streams_and_exits_non_zero(model_dir):
    port = free_port()
    env = dict(os.environ, KVSERVE_COMPILE="off")
    process, lines = start_subprocess("--model", str(model_dir("long")), "--port", str(port), "--device", "cpu",
                                      "--dtype", "float32", env=env, program=("-c", FAULTY_SERVER))
    try:
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{url}/health").status_code == 200
        body = {"prompt": "hi", "stream": True, "max_tokens": 50, "ignore_eos": True}
        with httpx.Client(base_url=url, timeout=60) as client, connect_sse(client, "POST", "/v1/completions", json=body) as source:
            events = [e.data for e in source.iter_sse()]
        assert events[-1] == "[DONE]"
        assert "the engine loop stopped: RuntimeError: injected fault" in json.loads(events[-2])["error"]["message"]
        assert process.wait(60) == 1  # a supervisor sees the failure and restarts it
        output = process.stdout.read()
        assert "the engine loop stopped" in output
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
