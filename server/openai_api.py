"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models."""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from typing import AsyncIterator, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine import FinishReason, TokenEvent, Tokenizer
from server import generation, sse
from server.errors import APIError, error_body
from server.schemas import ChatCompletionRequest, CompletionRequest, OpenAISampling

OPENAI_FINISH = {FinishReason.LENGTH: "length", FinishReason.EOS: "stop", FinishReason.STOP: "stop",
                 FinishReason.ABORT: "stop"}
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions


class StopTrimmer:
    """OpenAI excludes the stop string from the text: hold back what might be its beginning."""

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


def usage(gens: list[generation.Generation]) -> dict:
    """One prompt for all choices; the tokens of every choice."""
    prompt, completion = len(gens[0].stream.prompt_ids), sum(len(g.events) for g in gens)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": gens[0].reused_prompt_tokens}}


def model_name(request: Request) -> str:
    return request.app.state.settings.served_model_name


async def admit(body: OpenAISampling, request: Request, prompt_ids: list[int], max_tokens: int | None,
                default: int) -> list[generation.Generation]:
    runner, metrics = request.app.state.runner, request.app.state.metrics
    params = generation.validated(lambda: body.sampling(max_tokens, default))
    await generation.compile_grammar(runner, params)
    return generation.start_sequences(runner, metrics, prompt_ids, params, body.n, "n")


async def merged(streams: list[AsyncIterator[dict]]) -> AsyncIterator[dict]:
    """The items of several async iterators as they come; the first exception ends all of them."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield item
        return
    queue: asyncio.Queue = asyncio.Queue()
    finished = object()

    async def pump(stream: AsyncIterator[dict]) -> None:
        try:
            async for item in stream:
                await queue.put(item)
        except Exception as e:  # handed to the consumer, which raises it
            await queue.put(e)
        await queue.put(finished)

    tasks = [asyncio.create_task(pump(stream)) for stream in streams]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is finished:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:  # a client gone, or a choice failed: the other choices stop, and release their slots
        for task in tasks:
            task.cancel()


def completion_logprobs(entries: list[tuple[str, float | None, dict | None]], offset: int, alternatives: int) -> dict:
    """The completions shape from (text, logprob, {text: logprob} alternatives) per token; texts start at `offset`."""
    starts = list(itertools.accumulate((len(text) for text, _, _ in entries), initial=offset))[:-1]
    return {"tokens": [text for text, _, _ in entries], "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [top for _, _, top in entries] if alternatives else None, "text_offset": starts}


def joined(first: dict, second: dict) -> dict:
    """Two completions logprobs blocks as one, `first`'s tokens before `second`'s."""
    return {key: None if value is None else value + second[key] for key, value in first.items()}


def alternatives(top: tuple[tuple[int, float], ...], tokenizer: Tokenizer) -> dict[str, float]:
    """The completions shape of a token's alternatives: {text: logprob}."""
    return {tokenizer.token_text(i): lp for i, lp in top}


def generated_entries(events: list[TokenEvent], tokenizer: Tokenizer) -> list[tuple[str, float | None, dict | None]]:
    return [(e.text, e.logprob, alternatives(e.top_logprobs, tokenizer)) for e in events]


def prompt_entries(prompt_ids: list[int], first: TokenEvent, tokenizer: Tokenizer) -> list[tuple[str, float | None, dict | None]]:
    """The echoed prompt's tokens; the first has nothing before it to be scored by."""
    texts = [tokenizer.token_text(i) for i in prompt_ids]
    return [(texts[0], None, None)] + [(text, c.logprob, alternatives(c.top, tokenizer))
                                       for text, c in zip(texts[1:], first.prompt_logprobs or ())]


def chat_logprobs(events: list[TokenEvent], tokenizer: Tokenizer) -> dict:
    """The chat shape: per token its text, logprob and UTF-8 bytes, and the same for each alternative."""
    def entry(text: str, logprob: float) -> dict:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [entry(e.text, e.logprob) | {"top_logprobs": [entry(tokenizer.token_text(i), lp)
                                                                      for i, lp in e.top_logprobs]}
                        for e in events]}


async def choice_chunks(gen: generation.Generation, body: OpenAISampling, make_chunk,
                        lead: Callable[[TokenEvent], dict] | None) -> AsyncIterator[dict]:
    """The chunks of one choice; `lead(first_event)`, when given, is one chunk sent before the generated text."""
    trimmer = StopTrimmer(body.stops)
    pending: list[TokenEvent] = []  # tokens whose text is held back still owe their logprobs to the next chunk
    async for event in gen:
        if lead is not None and event.index == 0:
            yield lead(event)
        pending.append(event)
        piece = trimmer.push(event)
        finish = OPENAI_FINISH[event.finish_reason] if event.finish_reason else None
        if piece or finish:
            yield make_chunk(piece, finish, pending)
            pending = []


async def openai_stream(gens: list[generation.Generation], body: OpenAISampling, chunk_maker, include_usage: bool,
                        lead_maker: Callable[[int], Callable[[TokenEvent], dict]] | None = None):
    """SSE chunks of every choice as they come; chunk_maker(i) and lead_maker(i) build choice i's chunks."""
    try:
        chunks = [choice_chunks(gen, body, chunk_maker(i), lead_maker and lead_maker(i)) for i, gen in enumerate(gens)]
        async for chunk in merged(chunks):
            yield sse.event(chunk)
        if include_usage:
            yield sse.event(chunk_maker(0)(None, None, []) | {"choices": [], "usage": usage(gens)})
    except APIError as e:
        yield sse.event(error_body("/v1", e.status, e.message, e.error_type))
    yield sse.event("[DONE]")


def sse_response(body) -> StreamingResponse:
    return StreamingResponse(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def create_router() -> APIRouter:
    router = APIRouter(prefix="/v1")

    @router.get("/models")
    async def models(request: Request):
        runner = request.app.state.runner
        generation.ensure_ready(runner)
        return {"object": "list", "data": [{
            "id": model_name(request), "object": "model", "created": request.app.state.started, "owned_by": "kvserve",
            "max_model_len": runner.engine.max_seq_len}]}

    @router.post("/completions")
    async def completions(body: CompletionRequest, request: Request):
        runner = request.app.state.runner
        if isinstance(body.prompt, str):
            prompt_ids = await generation.tokenize_prompt(runner, body.prompt, body.parse_special)
            prompt_text = body.prompt
        else:  # token ids, as vLLM takes them: echoed as their text
            prompt_ids = generation.checked_token_ids(runner, body.prompt)
            prompt_text = runner.engine.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        gens = await admit(body, request, prompt_ids, body.max_tokens, DEFAULT_COMPLETION_TOKENS)
        ident, created, name = f"cmpl-{uuid.uuid4().hex}", int(time.time()), model_name(request)
        want_logprobs, tokenizer = body.logprobs is not None, runner.engine.tokenizer

        def chunk_maker(index: int):
            offset = len(prompt_text) if body.echo else 0  # where the next token's text starts in the returned text

            def chunk(text, finish, events, logprobs=None):
                nonlocal offset
                if logprobs is None and want_logprobs and events:
                    logprobs = completion_logprobs(generated_entries(events, tokenizer), offset, body.top_alternatives)
                    offset += sum(len(e.text) for e in events)
                choice = {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}
                return {"id": ident, "object": "text_completion", "created": created, "model": name, "choices": [choice]}

            return chunk

        def echo_maker(index: int):
            def echoed(first: TokenEvent) -> dict:
                """The prompt as the first chunk of the answer, with its tokens' logprobs when asked."""
                logprobs = None
                if want_logprobs:
                    logprobs = completion_logprobs(prompt_entries(prompt_ids, first, tokenizer), 0, body.top_alternatives)
                return chunk_maker(index)(prompt_text, None, [], logprobs)

            return echoed

        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        if body.stream:
            return sse_response(openai_stream(gens, body, chunk_maker, include_usage, echo_maker if body.echo else None))
        await generation.complete_all(gens, request)
        choices = []
        for index, gen in enumerate(gens):
            text = "".join(StopTrimmer(body.stops).push(e) for e in gen.events)
            choice = chunk_maker(index)(text, OPENAI_FINISH[gen.events[-1].finish_reason], gen.events)["choices"][0]
            if body.echo:  # the prompt's chunk and the generated one, joined
                lead = echo_maker(index)(gen.events[0])["choices"][0]
                choice["text"] = lead["text"] + choice["text"]
                if want_logprobs:
                    choice["logprobs"] = joined(lead["logprobs"], choice["logprobs"])
            choices.append(choice)
        return JSONResponse({"id": ident, "object": "text_completion", "created": created, "model": name,
                             "choices": choices, "usage": usage(gens)})

    @router.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        runner = request.app.state.runner
        prompt_ids = await generation.tokenize_chat(runner, body.rendered_messages(), body.parse_special)
        max_tokens = body.max_completion_tokens or body.max_tokens
        gens = await admit(body, request, prompt_ids, max_tokens, max(1, generation.room(runner, prompt_ids)))
        ident, created, name = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), model_name(request)

        def chunk_maker(index: int):
            first = True

            def chunk(text, finish, events):
                nonlocal first
                delta = {} if text is None else {"content": text}
                if first and text is not None:
                    delta, first = {"role": "assistant", **delta}, False
                logprobs = chat_logprobs(events, runner.engine.tokenizer) if body.logprobs and events else None
                choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
                return {"id": ident, "object": "chat.completion.chunk", "created": created, "model": name,
                        "choices": [choice]}

            return chunk

        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        if body.stream:
            return sse_response(openai_stream(gens, body, chunk_maker, include_usage))
        await generation.complete_all(gens, request)
        choices = [{"index": index, "message": {"role": "assistant",
                                                "content": "".join(StopTrimmer(body.stops).push(e) for e in gen.events)},
                    "logprobs": chat_logprobs(gen.events, runner.engine.tokenizer) if body.logprobs else None,
                    "finish_reason": OPENAI_FINISH[gen.events[-1].finish_reason]} for index, gen in enumerate(gens)]
        return JSONResponse({"id": ident, "object": "chat.completion", "created": created, "model": name,
                             "choices": choices, "usage": usage(gens)})

    return router
