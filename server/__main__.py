"""python -m server: serve a model on 127.0.0.1:8000 (the default model unless --model says otherwise)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from pathlib import Path

import uvicorn

from engine import Engine
from server.app import create_app
from server import compile_cache, tensor_parallel
from server.compile_cache import CompileCache
from server.runner import EngineRunner
from server.settings import Settings, parse
from weights.loading import load_engine


class Server(uvicorn.Server):
    """uvicorn, with SIGINT/SIGTERM ending open streams at once and the process exiting 0 afterwards."""

    def __init__(self, config: uvicorn.Config, runner: EngineRunner):
        super().__init__(config)
        self.runner = runner
        self.workers: tensor_parallel.Workers | None = None  # tensor-parallel ranks 1.. on this machine, ended with the server

    def handle_exit(self, sig, frame) -> None:
        # Open streams end now with an error event, rather than hold the shutdown until they finish.
        self.runner.end_streams_threadsafe()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self):
        # uvicorn's own version re-raises the signal after shutdown, so a clean stop would exit -15.
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def build(settings: Settings, cache: CompileCache) -> Server:
    """The server for `settings`, its compiled code kept by `cache`."""
    def load() -> Engine:
        from weights.resolve import resolve_model

        path = resolve_model(settings.model)
        logging.getLogger("kvserve").info("loading %s", path)
        if settings.tensor_parallel_size == 1:
            return load_engine(path, settings.engine_config())
        engine, server.workers = tensor_parallel.start(settings, str(path), on_worker_exit)
        return engine

    def on_worker_exit(message: str) -> None:
        if server.should_exit:  # shutting down: the workers were told to stop
            logging.getLogger("kvserve").info(message)
        else:  # the group is broken: fail now (503, open streams end), exit 1 for a supervisor to restart
            runner.fail(message)

    def stop() -> None:  # a server without a model, or without its engine loop, serves nobody: exit 1
        server.should_exit = True

    runner = EngineRunner(load, max_queue=settings.max_queue, compile_cache=cache, on_failure=stop,
                          request_timeout=settings.request_timeout, max_queue_wait=settings.max_queue_wait)
    app = create_app(runner, settings)  # the model loads in the background: /health answers 503 until ready
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="info", timeout_graceful_shutdown=10)
    server = Server(config, runner)
    return server


def main(argv: list[str] | None = None) -> int:
    settings = parse(argv)
    from weights.default_model import kvserve_home

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Inductor's generated code survives restarts under KVSERVE_HOME (a compile takes minutes on 2 cores), checked
    # before anything there is loaded (server/compile_cache.py); the child that compiles inherits the folder. The
    # child takes the server's flags.
    owned = not os.environ.get("TORCHINDUCTOR_CACHE_DIR")  # a folder the environment names is not kvserve's to clear
    compiled = compile_cache.prepared(Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or kvserve_home() / "compiled"),
                                      owned)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(compiled)
    if settings.node_rank > 0:  # another machine's tensor-parallel ranks: no HTTP here
        from weights.resolve import resolve_model

        return tensor_parallel.run_node(settings, str(resolve_model(settings.model)))
    server = build(settings, CompileCache(compiled, sys.argv[1:] if argv is None else argv, owned))
    server.run()
    server.runner.compile_cache.end()
    code = 1 if server.runner.failure else 0
    if server.workers is not None:
        server.workers.end()
        logging.shutdown()
        os._exit(code)  # gloo's teardown at interpreter exit can abort (and turn 0 into 134)
    return code


if __name__ == "__main__":
    sys.exit(main())
