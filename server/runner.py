"""Runs the engine's step loop on a thread of its own and streams its events to asyncio tasks.

Only the loop thread steps the engine. Requests and aborts reach it through a queue; its
events come back to the event loop with `call_soon_threadsafe`, one batch per step. The one
other thread is the compiler's: `Engine.compile` builds decode graphs on a scratch cache and
hands each over when ready, while the loop thread goes on decoding eagerly.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import traceback
import uuid
from dataclasses import dataclass
from typing import Callable

from engine import Engine, RequestFailed, SamplingParams, TokenEvent
from engine.scheduler import SlotState
from engine.tensor_parallel import PeerLost
from server.compile_cache import CompileCache

log = logging.getLogger("kvserve.runner")


class Overloaded(Exception):
    """The waiting queue is full."""


class NotReady(Exception):
    """The model is still loading (or failed to load)."""


@dataclass(frozen=True)
class Snapshot:
    """What the loop thread last saw, for metrics and /info: plain numbers, safe to read anywhere."""

    running: int = 0
    waiting: int = 0
    slots: int = 0
    capacity_bytes: int = 0
    used_bytes: int = 0
    weights_bytes: int = 0
    kept_bytes: int = 0
    slot_states: tuple[SlotState, ...] = ()

    @property
    def usage_ratio(self) -> float:
        return self.used_bytes / self.capacity_bytes if self.capacity_bytes else 0.0


@dataclass(frozen=True)
class Timed:
    """An engine event with when it reached the event loop and, for a first token, when its slot was granted."""

    event: TokenEvent
    at: float
    admitted_at: float | None = None


@dataclass(frozen=True)
class Failure:
    """The end of a stream that did not finish: the status and type its client is told."""

    message: str
    status: int = 500
    error_type: str = "internal"


class Stream:
    """The client side of one request: its events, in order, ending with a finished one or a Failure."""

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, arrived_at: float):
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.arrived_at = arrived_at
        self.queue: asyncio.Queue[Timed | Failure] = asyncio.Queue()
        self.finished = False
        self.seed: int | None = None

    async def next(self) -> Timed | Failure:
        item = await self.queue.get()
        if isinstance(item, Failure) or item.event.finish_reason is not None:
            self.finished = True
        return item


class EngineRunner:
    def __init__(self, load: Callable[[], Engine], max_queue: int = 64,
                 compile_cache: CompileCache | None = None, on_failure: Callable[[], None] | None = None,
                 request_timeout: float = 0, max_queue_wait: float = 0):
        self._load = load
        self.request_timeout = request_timeout  # seconds from arrival to the last token; 0: no limit
        self.max_queue_wait = max_queue_wait  # seconds a request may wait for a slot; 0: no limit
        self._arrivals: dict[str, float] = {}  # the loop thread's own: request id -> arrival, for the limits
        self.compile_cache = compile_cache  # inductor's code on disk: filled by a child first, recorded after
        self._on_failure = on_failure  # called (on the loop thread) once the runner can serve nobody
        self.max_queue = max_queue
        self.engine: Engine | None = None
        self.failure: str | None = None  # why nothing can be served: the model did not load, or the loop died
        self.snapshot = Snapshot()
        self.weights_bytes = 0
        self.step_observers: list[Callable[[float], None]] = []  # each told every engine step's seconds (loop thread)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, Stream] = {}
        self._active = 0  # accepted and not yet finished, counted on the event loop only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._compiled = threading.Event()  # the compile thread is done (compiled, not possible, or failed)
        self._changed = threading.Condition()  # notified whenever the snapshot changes

    # ---- lifecycle (event loop side) ----------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        self._thread.start()

    def end_streams(self) -> None:
        """End every open stream with a failure event (their requests are aborted as they close)."""
        self._end_streams("the server is shutting down", 503, "unavailable")

    def _end_streams(self, message: str, status: int, error_type: str) -> None:
        for stream in list(self._streams.values()):
            stream.queue.put_nowait(Failure(message, status, error_type))

    def end_streams_threadsafe(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.end_streams)

    async def stop(self) -> None:
        """End open streams and stop the loop thread."""
        self.end_streams()
        self._commands.put(("stop", None))
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self.engine is not None and self.failure is None

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._ready.wait(timeout)

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Block until the compile thread has finished, whatever its outcome."""
        return self._compiled.wait(timeout)

    def wait_for(self, predicate: Callable[[Snapshot], bool], timeout: float | None = None) -> bool:
        """Block until the loop thread publishes a snapshot that satisfies `predicate`."""
        with self._changed:
            return self._changed.wait_for(lambda: predicate(self.snapshot), timeout)

    # ---- requests (event loop side) -----------------------------------------------------------

    @property
    def waiting(self) -> int:
        """Accepted requests beyond the slots: they wait, first come first served."""
        return max(0, self._active - self.engine.slots) if self.engine else 0

    def arrived_at(self, request_id: str) -> float | None:
        """When a request in flight arrived (time.perf_counter), from the event loop's own streams."""
        stream = self._streams.get(request_id)
        return None if stream is None else stream.arrived_at

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> Stream:
        if not self.ready:
            raise NotReady(self.failure or "the model is still loading")
        if self.waiting >= self.max_queue and self._active >= self.engine.slots:
            raise Overloaded(f"{self.waiting} requests are already waiting (max_queue = {self.max_queue})")
        stream = Stream(f"req-{uuid.uuid4().hex[:16]}", prompt_ids, params, time.perf_counter())
        self._streams[stream.request_id] = stream
        self._active += 1
        self._commands.put(("add", stream))
        return stream

    def release(self, stream: Stream) -> None:
        """The client is done with a stream: abort it in the engine unless it already finished."""
        if self._streams.pop(stream.request_id, None) is None:
            return
        self._active -= 1
        if not stream.finished:
            self._commands.put(("abort", stream.request_id))

    def _deliver(self, items: list[tuple[str, Timed | Failure]]) -> None:
        for request_id, item in items:
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.queue.put_nowait(item)

    # ---- the loop thread ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.engine = self._load()
            self.weights_bytes = self.engine.weights_bytes  # fixed once loaded: counted here, not per step
        except Exception as e:  # reported by /health and every request, never a crash
            self.fail(f"the model failed to load: {type(e).__name__}: {e}")
            return
        self._update_snapshot()
        self._ready.set()
        log.info("ready: %d slots x %d tokens", self.engine.slots, self.engine.max_seq_len)
        threading.Thread(target=self._compile, name="kvserve-compile", daemon=True).start()
        try:
            self._serve()
            self.engine.close()
        except BaseException as e:  # a bug outside a step, or a lost tensor-parallel rank: nothing would serve
            if not isinstance(e, PeerLost):  # a lost rank is its message (which names it), not a bug to trace
                log.critical("the engine loop stopped:\n%s", traceback.format_exc())
            self.fail(f"the engine loop stopped: {type(e).__name__}: {e}")

    def fail(self, message: str) -> None:
        """From now on /health is 503 and requests are refused; open streams end with `message`; the owner
        is told (the server exits non-zero, so a supervisor restarts it)."""
        self.failure = message
        log.error(message)
        self._ready.set()
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._end_streams, message, 500, "internal")
        if self._on_failure is not None:
            self._on_failure()

    def _serve(self) -> None:
        while self._drain_commands(block=not self.engine.has_work):
            step_started = time.perf_counter()
            try:
                events = self.engine.step()
            except Exception:  # a bug: fail the requests in flight, keep serving the next ones
                log.error("engine step failed:\n%s", traceback.format_exc())
                self._fail_all("internal error during generation")
                continue
            self._update_snapshot()
            now = time.perf_counter()
            for observe in self.step_observers:
                observe(now - step_started)
            self._send([(e.request_id, self._timed(e, now, step_started)) for e in events])
            self._expire(now)

    def _expire(self, now: float) -> None:
        """End the requests past --max-queue-wait (still waiting for a slot) or --request-timeout."""
        expired = []
        for request_id, arrived in list(self._arrivals.items()):
            waits = self.engine.waits(request_id)
            if waits is None:  # finished
                del self._arrivals[request_id]
            elif self.max_queue_wait and waits and now - arrived > self.max_queue_wait:
                expired.append((request_id, Failure(f"no slot freed within --max-queue-wait ({self.max_queue_wait:g} s); "
                                                    "retry later", 503, "overloaded")))
            elif self.request_timeout and now - arrived > self.request_timeout:
                expired.append((request_id, Failure(f"the request ran past --request-timeout ({self.request_timeout:g} s)",
                                                    504, "timeout")))
        for request_id, _ in expired:
            self.engine.abort(request_id)
            del self._arrivals[request_id]
        if expired:
            self._update_snapshot()
            self._send(expired)

    @staticmethod
    def _timed(event: TokenEvent | RequestFailed, now: float, step_started: float) -> Timed | Failure:
        if isinstance(event, RequestFailed):  # this request alone: the rest of its batch went on
            return Failure(event.message, 422, "grammar") if event.by_grammar else Failure(event.message)
        return Timed(event, now, step_started if event.index == 0 else None)

    def _compile(self) -> None:
        cache = self.compile_cache
        try:
            if cache is None or not self.engine.compile_generates_code or self.engine.compile_blocker is not None:
                self.engine.compile()
                return
            with cache.in_use():
                cache.warm()
                if self.engine.compile():
                    cache.record()
        except Exception:  # serving goes on eagerly; a compiler failure is a log line, not an outage
            log.error("compiling the decode step failed; decoding stays eager:\n%s", traceback.format_exc())
        finally:
            self._compiled.set()

    def _drain_commands(self, block: bool) -> bool:
        """Apply queued adds and aborts; wait for one if there is nothing else to do. False to stop."""
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            return True
        while True:
            kind, payload = command
            if kind == "stop":
                return False
            if kind == "add":
                self._add(payload)
            elif kind == "abort":
                self.engine.abort(payload)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                self._update_snapshot()
                return True

    def _add(self, stream: Stream) -> None:
        try:
            request = self.engine.add_request(stream.prompt_ids, stream.params, request_id=stream.request_id)
            stream.seed = request.seed
            if self.request_timeout or self.max_queue_wait:
                self._arrivals[stream.request_id] = stream.arrived_at
        except Exception as e:  # validated before submission; anything left is reported, not raised
            self._send([(stream.request_id, Failure(f"{type(e).__name__}: {e}"))])

    def _fail_all(self, message: str) -> None:
        ids = list(self.engine.request_ids)
        for request_id in ids:
            self.engine.abort(request_id)
        self._update_snapshot()
        self._send([(request_id, Failure(message)) for request_id in ids])

    def _send(self, items: list) -> None:
        if items:
            self._loop.call_soon_threadsafe(self._deliver, items)

    def _update_snapshot(self) -> None:
        engine = self.engine
        with self._changed:
            self.snapshot = Snapshot(engine.num_running, engine.num_waiting, engine.slots,
                                     engine.cache_capacity_bytes, engine.cache_used_bytes, self.weights_bytes,
                                     engine.cache_kept_bytes, engine.slot_states())
            self._changed.notify_all()
