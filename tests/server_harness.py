"""Starts the real server (uvicorn over a real socket) on a free port, in-process or as a subprocess."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import uvicorn

from server.app import create_app
from server.runner import EngineRunner
from server.settings import Settings
from weights.loading import load_engine


class RunningServer:
    def __init__(self, runner: EngineRunner, url: str, settings: Settings):
        self.runner = runner
        self.url = url
        self.settings = settings


@contextlib.contextmanager
def serve(model: Path, load=None, wait: bool = True, **settings):
    """An in-process server; the socket listens before the thread starts, so no start-up race exists."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    port = sock.getsockname()[1]
    options = dict(model=str(model), port=port, device="cpu", dtype="float32", max_batch_size=4, max_seq_len=512,
                   seed=0, compile="off") | settings
    config = Settings(**options)
    runner = EngineRunner(load or (lambda: load_engine(model, config.engine_config())),
                          max_queue=config.max_queue, request_timeout=config.request_timeout,
                          max_queue_wait=config.max_queue_wait)
    server = uvicorn.Server(uvicorn.Config(create_app(runner, config), log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        if wait:
            assert runner.wait_ready(120) and runner.ready, runner.failure
        yield RunningServer(runner, f"http://127.0.0.1:{port}", config)
    finally:
        server.should_exit = True
        thread.join(60)
        sock.close()


def start_subprocess(*args: str, env: dict | None = None,
                     program: tuple[str, ...] = ("-m", "server")) -> tuple[subprocess.Popen, list[str]]:
    """`python -m server ARGS` (or another `program` taking those ARGS); returns once it logs that the model is
    loaded, with the lines it printed."""
    process = subprocess.Popen([sys.executable, *program, *args], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=env or dict(os.environ))
    lines = []
    for line in process.stdout:  # blocking reads: the log is the synchronisation
        lines.append(line)
        if "ready:" in line or "failed to load" in line:
            break
    return process, lines


def metric_values(text: str) -> dict[str, float]:
    """/metrics text as {name, with its labels as JSON when it has any: value}."""
    from prometheus_client.parser import text_string_to_metric_families

    return {f"{s.name}{json.dumps(s.labels, sort_keys=True) if s.labels else ''}": s.value
            for family in text_string_to_metric_families(text) for s in family.samples}
