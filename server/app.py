"""The FastAPI application: routes translate HTTP to engine calls; nothing here generates or validates."""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.linear.planner import served_by_type, summary
from server import anthropic_api, generation, openai_api, responses_api, tgi
from server.errors import APIError, GenerationFailed, error_response
from server.metrics import Metrics
from server.openapi import OPEN_PATHS, install_openapi
from server.response_store import ResponseStore
from server.runner import EngineRunner
from server.schemas import DetokenizeRequest, TokenizeRequest
from server.settings import Settings


def create_app(runner: EngineRunner, settings: Settings) -> FastAPI:
    metrics = Metrics(runner)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        runner.start()
        yield
        await runner.stop()

    app = FastAPI(title="kvserve", lifespan=lifespan)
    app.state.runner, app.state.metrics, app.state.settings = runner, metrics, settings
    app.state.started = int(time.time())
    app.state.responses = ResponseStore(settings.responses_store, settings.responses_store_bytes)
    install_error_handlers(app, metrics)
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes, metrics=metrics)
    if settings.api_key:
        install_api_key(app, settings.api_key, metrics)
    if settings.ui == "on":
        install_playground(app)
    app.include_router(tgi.create_router())
    app.include_router(openai_api.create_router())
    app.include_router(anthropic_api.create_router())
    app.include_router(responses_api.create_router())
    install_openapi(app)

    @app.get("/health")
    async def health():
        if runner.ready:
            return {"status": "ok"}
        status = "failed" if runner.failure else "loading"
        return JSONResponse({"status": status, "error": runner.failure}, status_code=503)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/info")
    async def info():
        generation.ensure_ready(runner)
        engine = runner.engine
        capacity, plan = engine.cache_capacity_bytes, list(engine.plan)
        return {
            "model_id": settings.served_model_name, "model_path": settings.model_spec,
            "model_type": engine.model_config.model_type, "dtype": str(engine.dtype).removeprefix("torch."),
            "device": str(engine.device), "max_batch_size": engine.slots, "max_seq_len": engine.max_seq_len,
            "max_queue": runner.max_queue, "compiled_decode": list(engine.compiled_graphs),
            "quantized": engine.quantized, "weights_bytes": runner.weights_bytes,
            "weights_on_huge_pages_bytes": engine.model.pages.huge,
            "prefix_caching": engine.config.prefix_caching, "speculative_decoding": engine.speculation,
            # Which layer serves each linear product and why, decided once as the model was built.
            "linear_layers": summary(plan), "weights_served": served_by_type(plan),
            "kv_cache": engine.cache_terms(),
            # Each rank's cache holds its own K/V heads (h_kv above is per rank); every rank's is the same size.
            "tensor_parallel": {"size": engine.tensor_parallel_size, "kv_cache_bytes_per_rank": capacity,
                                "kv_cache_bytes_total": engine.tensor_parallel_size * capacity},
        }

    @app.get("/slots")
    async def slots():
        """Every KV-cache slot as the loop thread last saw it, the queue, and the cache's size (llama.cpp's name)."""
        generation.ensure_ready(runner)
        snapshot, now = runner.snapshot, time.perf_counter()

        def age(request_id: str | None) -> float | None:
            arrived = runner.arrived_at(request_id) if request_id else None
            return None if arrived is None else now - arrived

        return {
            "slots": [{"slot": s.slot, "state": s.state, "tokens": s.tokens, "kept": s.kept, "request_id": s.request_id,
                       "age_s": age(s.request_id)} for s in snapshot.slot_states],
            "max_seq_len": runner.engine.max_seq_len, "waiting": snapshot.waiting, "running": snapshot.running,
            "kv_cache": {"capacity_bytes": snapshot.capacity_bytes, "used_bytes": snapshot.used_bytes,
                         "kept_bytes": snapshot.kept_bytes,
                         "mha_capacity_bytes": runner.engine.cache_terms()["mha_capacity_bytes"]},
        } | metrics.summary()

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        generation.ensure_ready(runner)
        tokenizer = runner.engine.tokenizer

        def tokens_json() -> bytes:  # a megabyte of text is seconds of work: a worker thread's, not the event loop's
            encoding = tokenizer.encoding(body.inputs, parse_special=body.special_tokens_parsed)
            return json.dumps([{"id": i, "text": body.inputs[start:stop], "start": start, "stop": stop}
                               for i, (start, stop) in zip(encoding.ids, encoding.offsets)]).encode()

        return Response(await asyncio.to_thread(tokens_json), media_type="application/json")

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        generation.ensure_ready(runner)
        vocab = runner.engine.tokenizer.vocab_size
        if any(t >= vocab for t in body.tokens):
            raise APIError(422, f"token ids must be in [0, {vocab})", "validation")
        text = await asyncio.to_thread(runner.engine.tokenizer.decode, body.tokens, body.skip_special_tokens)
        return {"prompt": text}

    return app


def install_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        if not isinstance(e, GenerationFailed):  # those were counted where they happened
            metrics.failures.labels(reason=e.error_type).inc()
        return error_response(request.url.path, e.status, e.message, e.error_type, e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        metrics.failures.labels(reason="validation").inc()
        return error_response(request.url.path, 422, describe(e), "validation")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        if e.status_code == 400:  # FastAPI's answer to a body it cannot decode: the cause says why
            metrics.failures.labels(reason="validation").inc()
            message = ("the request body nests arrays or objects too deeply to be parsed"
                       if isinstance(e.__cause__, RecursionError)
                       else "the request body is not valid JSON (it must be UTF-8 encoded JSON)")
            return error_response(request.url.path, 422, message, "validation")
        return error_response(request.url.path, e.status_code, str(e.detail), "http", headers=e.headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception):  # a bug; say so without a stack trace
        metrics.failures.labels(reason="internal").inc()
        return error_response(request.url.path, 500, f"internal error: {type(e).__name__}", "internal")


def describe(e: RequestValidationError) -> str:
    """Pydantic's errors as one readable line: 'parameters.max_tokens: extra inputs are not permitted'."""
    parts = []
    for error in e.errors():
        location = ".".join(str(p) for p in error.get("loc", ()) if p != "body")
        message = error.get("msg", "invalid")
        if error.get("type") == "json_invalid":
            message = "the body is not valid JSON" + (f" ({error['ctx']['error']})" if error.get("ctx") else "")
            location = ""
        parts.append(f"{location}: {message}" if location else message)
    return "; ".join(parts) or "invalid request"


def install_playground(app: FastAPI) -> None:
    """GET / from a browser (Accept: text/html) is the playground; its files are under /ui. POST / stays TGI's."""
    files = Path(__file__).parent / "ui"
    kinds = {".html": "text/html", ".css": "text/css", ".js": "text/javascript"}

    @app.get("/", include_in_schema=False)
    async def playground(request: Request):
        if "text/html" not in request.headers.get("accept", ""):  # an API client: as before, POST only
            return error_response("/", 405, "Method Not Allowed", "http", headers={"Allow": "POST"})
        return FileResponse(files / "index.html", media_type="text/html")

    @app.get("/ui/{name}", include_in_schema=False)
    async def asset(name: str):
        path = files / name
        if path.suffix not in kinds or path.parent != files or not path.is_file():
            return error_response("/ui", 404, f"no such file: {name}", "http")
        return FileResponse(path, media_type=kinds[path.suffix])


def install_api_key(app: FastAPI, key: str, metrics: Metrics) -> None:
    expected = key.encode()

    def authorized(request: Request) -> bool:
        """'Authorization: Bearer KEY', the scheme in any case (RFC 7235), or 'x-api-key: KEY' (Anthropic's
        clients); the key compared in constant time."""
        scheme, _, credentials = (request.headers.get("authorization") or "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(credentials.strip().encode(), expected):
            return True
        return hmac.compare_digest((request.headers.get("x-api-key") or "").strip().encode(), expected)

    @app.middleware("http")
    async def check_key(request: Request, call_next):  # the playground's files are open: it asks for the key
        page = request.method == "GET" and (request.url.path == "/" or request.url.path.startswith("/ui/"))
        if request.url.path in OPEN_PATHS or page or authorized(request):
            return await call_next(request)
        metrics.failures.labels(reason="unauthorized").inc()
        return error_response(request.url.path, 401, "missing or wrong API key (send 'Authorization: Bearer KEY' "
                              "or 'x-api-key: KEY')", "unauthorized")


class BodyLimit:
    """Refuses request bodies over `limit` bytes with 413, by Content-Length or by counting a chunked body.

    The body is read here (it is at most `limit` bytes) and replayed to the app, so an oversized one
    is refused before any route or parser sees it.
    """

    def __init__(self, app, limit: int, metrics: Metrics):
        self.app, self.limit, self.metrics = app, limit, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers", [])).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await self.refuse(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await self.refuse(scope, receive, send)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: only http.disconnect comes

        await self.app(scope, replay, send)

    async def refuse(self, scope, receive, send):
        self.metrics.failures.labels(reason="payload_too_large").inc()
        response = error_response(scope["path"], 413, f"request body exceeds {self.limit} bytes", "payload_too_large")
        await response(scope, receive, send)
