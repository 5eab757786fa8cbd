"""The part of every generation route that is the same: admission, the event stream, metrics."""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from fastapi import Request

from engine import InvalidParameter, SamplingParams, TokenEvent
from server import reasoning, tool_calls
from server.conversation import Conversation, Prompt
from server.errors import APIError, GenerationFailed
from server.metrics import Metrics
from server.runner import EngineRunner, Failure, NotReady, Overloaded, Stream
from server.settings import Settings

REASONING_TAIL = 16  # prompt tokens read back to see whether the template opened the reply's <think>


@dataclass
class Generation:
    """One accepted request, from its first token to its last, as a route consumes it."""

    runner: EngineRunner
    metrics: Metrics
    stream: Stream
    events: list[TokenEvent] = field(default_factory=list)

    @property
    def reused_prompt_tokens(self) -> int:
        """Leading prompt tokens whose K/V a slot had kept (prefix caching): not computed again."""
        return (self.events[0].reused_prompt_tokens or 0) if self.events else 0

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events)

    @property
    def draft_tokens(self) -> tuple[int, int]:
        """(proposed, accepted): the draft tokens speculative decoding verified for this request, and those kept."""
        drafts = [e.draft for e in self.events if e.draft is not None]
        return sum(d.proposed for d in drafts), sum(d.accepted for d in drafts)

    async def __aiter__(self) -> AsyncIterator[TokenEvent]:
        """Events in order; a failure after the stream started raises APIError."""
        stream, metrics = self.stream, self.metrics
        last_at = None
        try:
            while True:
                item = await stream.next()
                if isinstance(item, Failure):
                    metrics.failures.labels(reason=item.error_type).inc()
                    retry = {"Retry-After": "1"} if item.status in (429, 503) else None
                    raise GenerationFailed(item.status, item.message, item.error_type, retry)
                if last_at is None:
                    metrics.time_to_first_token.observe(item.at - stream.arrived_at)
                    metrics.prefix_queried_tokens.inc(len(stream.prompt_ids))
                    metrics.prefix_hit_tokens.inc(item.event.reused_prompt_tokens or 0)
                    metrics.request_queue.observe(item.admitted_at - stream.arrived_at)
                else:
                    metrics.inter_token_latency.observe(item.at - last_at)
                last_at = item.at
                self.events.append(item.event)
                metrics.generation_tokens.inc()
                if item.event.draft is not None:
                    metrics.observe_draft(item.event.draft)
                if item.event.finish_reason is not None:
                    metrics.request_duration.observe(item.at - stream.arrived_at)
                    metrics.requests.labels(finish_reason=item.event.finish_reason.value).inc()
                yield item.event
                if item.event.finish_reason is not None:
                    return
        finally:
            if not stream.finished:  # the stream was cancelled: its client went away
                metrics.failures.labels(reason="client_disconnect").inc()
            self.runner.release(stream)

    async def complete(self, request: Request) -> "Generation":
        """Run to the end; a client that disconnects meanwhile aborts the request."""
        watcher = asyncio.create_task(self._watch_disconnect(request))
        try:
            async for _ in self:
                pass
        finally:
            watcher.cancel()
        return self

    async def _watch_disconnect(self, request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.runner.release(self.stream)
        self.stream.queue.put_nowait(Failure("client disconnected", 499, "client_disconnect"))


class StopTrimmer:
    """OpenAI and Anthropic exclude the stop string from the text: hold back what might be its beginning."""

    def __init__(self, stops: tuple[str, ...]):
        self.hold = max(map(len, stops), default=1) - 1
        self.text = ""
        self.sent = 0

    def push(self, event: TokenEvent) -> str:
        self.text += event.text
        if event.stop_string is not None:
            end = self.text.find(event.stop_string)
        elif event.finish_reason is not None:
            end = len(self.text)
        else:
            end = len(self.text) - self.hold
        piece = self.text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return piece


def trimmed_text(events: list[TokenEvent], stops: tuple[str, ...]) -> str:
    """A whole reply's text as its stream sends it: up to, not including, the stop string that ended it (one
    trimmer over all the events: each event's text may hold the start of a stop string the next completes)."""
    trimmer = StopTrimmer(stops)
    return "".join(trimmer.push(e) for e in events)


async def tokenize_prompt(runner: EngineRunner, text: str, parse_special: bool) -> list[int]:
    """The prompt's ids, tokenized on a worker thread (a long text takes seconds, and the event loop serves every
    stream). Special-token strings in it are text unless `parse_special`."""
    check_length(runner, len(text))
    ids = await asyncio.to_thread(runner.engine.tokenizer.encode, text, True, parse_special)
    return nonempty(ids)


async def tokenize_chat(runner: EngineRunner, messages: list[dict], parse_special: bool,
                        tools: list[dict] | None = None, variables: dict | None = None) -> list[int]:
    """The chat template's rendering of `messages`, tokenized on a worker thread: the template's markers special,
    the messages' text as text unless `parse_special` (see Tokenizer.encode_chat)."""
    check_length(runner, sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str)))
    try:  # a template runs Python over every message: off the event loop too
        ids = await asyncio.to_thread(runner.engine.tokenizer.encode_chat, messages, parse_special, tools, variables)
    except Exception as e:  # a template that raises on these messages is the client's to fix
        raise APIError(422, f"the chat template could not render these messages: {e}", "validation") from None
    return nonempty(ids)


def conversation(runner: EngineRunner, settings: Settings, build: Callable[[str], Conversation]) -> Conversation:
    """A chat-shaped request's Conversation, built by `build(tool format)` with the format the served model writes
    its calls in (tool_calls.chosen: from --tool-call-parser and the chat template) and its reasoning format
    (reasoning.chosen: from --reasoning-parser and the template); its errors are 422s."""
    ensure_ready(runner)
    tokenizer = runner.engine.tokenizer
    source = tokenizer.chat_template and tokenizer.chat_template.source
    form = tool_calls.chosen(settings.tool_call_parser, source, tokenizer.template_takes_tools)
    chat = validated(lambda: build(form))
    return dataclasses.replace(chat, reasoning_format=reasoning.chosen(settings.reasoning_parser, source))


async def tokenize_conversation(runner: EngineRunner, chat: Conversation, parse_special: bool) -> Prompt:
    """The conversation as the chat template renders it (tools through the template or offered in a system
    message), tokenized as tokenize_chat does, with whether the rendering leaves a `<think>` open."""
    messages, tools = chat.rendered(runner.engine.tokenizer.template_takes_tools)
    ids = await tokenize_chat(runner, messages, parse_special, tools, chat.template_variables)
    tail = runner.engine.tokenizer.decode(ids[-REASONING_TAIL:], skip_special_tokens=False)
    return Prompt(chat, ids, reasoning.opened_by(tail))


def check_length(runner: EngineRunner, characters: int) -> None:
    """A text too long to fit the context whatever its tokens is refused before any work."""
    ensure_ready(runner)
    engine = runner.engine
    if characters > engine.max_seq_len * engine.tokenizer.max_token_chars:
        raise APIError(422, f"the prompt has {characters} characters, more than any {engine.max_seq_len} tokens "
                            f"(max_seq_len) hold", "validation")


def nonempty(ids: list[int]) -> list[int]:
    if not ids:
        raise APIError(422, "the prompt is empty after tokenization", "validation")
    return ids


def checked_token_ids(runner: EngineRunner, ids: list[int]) -> list[int]:
    """A prompt given as token ids, checked now by the engine's own rule (the loop thread adds it later)."""
    ensure_ready(runner)
    validated(lambda: runner.engine.check_prompt_ids(ids))
    return ids


def ensure_ready(runner: EngineRunner) -> None:
    if not runner.ready:
        raise APIError(503, runner.failure or "the model is still loading; retry shortly", "unavailable",
                       {"Retry-After": "5"})


def room(runner: EngineRunner, prompt_ids: list[int]) -> int:
    """Tokens that fit after the prompt in one cache slot."""
    return runner.engine.max_seq_len - len(prompt_ids)


def start(runner: EngineRunner, metrics: Metrics, prompt_ids: list[int], params: SamplingParams) -> Generation:
    """Admit a request or refuse it with the status a client should see."""
    max_seq_len = runner.engine.max_seq_len
    if len(prompt_ids) >= max_seq_len:  # said before any default token count is blamed for it
        raise APIError(422, f"the prompt is {len(prompt_ids)} tokens: with the context length max_seq_len = "
                            f"{max_seq_len} that leaves no room for a new token", "validation")
    validated(lambda: runner.engine.check_fits(len(prompt_ids), params.max_new_tokens))
    try:
        stream = runner.submit(prompt_ids, params)
    except Overloaded as e:
        raise APIError(429, f"too many requests waiting: {e}", "overloaded", {"Retry-After": "1"}) from None
    except NotReady as e:
        raise APIError(503, str(e), "unavailable", {"Retry-After": "5"}) from None
    metrics.prompt_tokens.inc(len(prompt_ids))
    return Generation(runner, metrics, stream)


async def admit(runner: EngineRunner, metrics: Metrics, prompt_ids: list[int], sampling: Callable[[], SamplingParams],
                n: int = 1, name: str = "n") -> list[Generation]:
    """Every route's admission: the request's parameters (`sampling()`, whose InvalidParameter is a 422), its
    grammar compiled, then its n sequences started (start_sequences)."""
    params = validated(sampling)
    await compile_grammar(runner, params)
    return start_sequences(runner, metrics, prompt_ids, params, n, name)


async def compile_grammar(runner: EngineRunner, params: SamplingParams) -> None:
    """The request's grammar compiled on a worker thread (or refused: 422), so that the engine thread, admitting
    the request, only copies it from the cache of compiled grammars."""
    if params.grammar is not None:
        await asyncio.to_thread(validated, lambda: runner.engine.grammars.compile(params.grammar))


def start_sequences(runner: EngineRunner, metrics: Metrics, prompt_ids: list[int], params: SamplingParams,
                    n: int, name: str) -> list[Generation]:
    """n sequences of one prompt (OpenAI's `n`, TGI's `best_of`), all admitted or none. Sequence i samples
    with seed + i when a seed is given (so sequence 0 is what the request alone gives), else with a seed of
    its own. They share the prompt: prefix caching computes it once when it is at least a prefill chunk long
    (a shorter one is computed for each)."""
    slots = runner.engine.slots
    if n > slots:
        raise APIError(422, f"{name}={n} exceeds the server's {slots} sequence slots (--max-batch-size): "
                            "the sequences are decoded side by side", "validation")
    gens: list[Generation] = []
    try:
        for i in range(n):
            seed = None if params.seed is None else params.seed + i  # past the seeds' range: a 422 that says so
            gens.append(start(runner, metrics, prompt_ids, validated(lambda: dataclasses.replace(params, seed=seed))))
    except APIError:
        for gen in gens:
            runner.release(gen.stream)
        raise
    return gens


async def complete_all(gens: list[Generation], request: Request) -> None:
    """Every sequence to its end; if one fails, the others are released and the failure raised."""
    tasks = [asyncio.ensure_future(gen.complete(request)) for gen in gens]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task, gen in zip(tasks, gens):
            task.cancel()
            gen.runner.release(gen.stream)


def validated(build):
    """Run a check or constructor of the engine's; its InvalidParameter becomes a 422."""
    try:
        return build()
    except InvalidParameter as e:
        raise APIError(422, str(e), "validation") from None
