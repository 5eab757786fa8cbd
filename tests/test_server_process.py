"""`python -m server` as a user runs it: flags, environment variables, and a clean exit on SIGTERM."""

from __future__ import annotations

import json
import os
import signal

import httpx
from httpx_sse import connect_sse

from tests.server_harness import free_port, start_subprocess


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
