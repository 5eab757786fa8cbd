"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models."""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine import FinishReason, TokenEvent, Tokenizer
from server import generation, sse
from server.conversation import Prompt
from server.generation import StopTrimmer
from server.errors import APIError, error_body
from server.schemas import ChatCompletionRequest, CompletionRequest, OpenAISampling

OPENAI_FINISH = {FinishReason.LENGTH: "length", FinishReason.EOS: "stop", FinishReason.STOP: "stop",
                 FinishReason.ABORT: "stop"}
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions


def usage(gens: list[generation.Generation]) -> dict:
    """One prompt for all choices; the tokens of every choice."""
    prompt, completion = len(gens[0].stream.prompt_ids), sum(len(g.events) for g in gens)
    proposed, accepted = (sum(n) for n in zip(*(g.draft_tokens for g in gens)))
    # Speculative decoding's drafts, in the fields OpenAI reports its predicted outputs' in.
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": gens[0].reused_prompt_tokens},
            "completion_tokens_details": {"accepted_prediction_tokens": accepted,
                                          "rejected_prediction_tokens": proposed - accepted}}


def model_name(request: Request) -> str:
    return request.app.state.settings.served_model_name


async def admit(body: OpenAISampling, request: Request, prompt_ids: list[int], max_tokens: int | None,
                default: int, prompt: Prompt | None = None) -> list[generation.Generation]:
    runner, metrics = request.app.state.runner, request.app.state.metrics
    return await generation.admit(runner, metrics, prompt_ids, lambda: body.sampling(max_tokens, default, prompt), body.n)


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


class Reply:
    """Everything one OpenAI response says, assembled in one place: its choices, whole or as stream chunks, and
    the response around them. A subclass per route says what a choice holds; state that builds up over a
    choice's chunks (the text offset of completions logprobs, chat's first delta) lives in its ChoiceText."""

    object: str
    chunk_object: str
    prefix: str

    def __init__(self, body: OpenAISampling, request: Request, tokenizer: Tokenizer):
        self.body, self.tokenizer = body, tokenizer
        self.id, self.created, self.model = f"{self.prefix}-{uuid.uuid4().hex}", int(time.time()), model_name(request)

    def envelope(self, object_name: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model, "choices": choices}

    def chunk(self, choice: "ChoiceText", text: str | None, finish: str | None, events: list[TokenEvent]) -> dict | None:
        """One stream chunk of a choice: `text` new since its last chunk, the tokens that made it, maybe its end;
        None while the choice holds its text back."""
        delta = choice.delta(text, finish, events)
        return None if delta is None else self.envelope(self.chunk_object, [delta])

    def whole(self, gens: list[generation.Generation]) -> dict:
        """The response to a request that did not stream: every choice complete, and the usage."""
        choices = []
        for index, gen in enumerate(gens):
            text = generation.trimmed_text(gen.events, self.body.stops)
            choices.append(self.choice(index).complete(text, OPENAI_FINISH[gen.events[-1].finish_reason], gen.events))
        return self.envelope(self.object, choices) | {"usage": usage(gens)}

    def choice(self, index: int) -> "ChoiceText":
        raise NotImplementedError

    def lead(self, choice: "ChoiceText", first: TokenEvent) -> dict | None:
        """A chunk sent before a choice's generated text, or None."""
        return None

    async def stream(self, gens: list[generation.Generation]) -> AsyncIterator[bytes]:
        """SSE chunks of every choice as they come, the usage when asked, then [DONE]; an error as one last event."""
        try:
            async for chunk in merged([self._choice_chunks(index, gen) for index, gen in enumerate(gens)]):
                yield sse.event(chunk)
            if self.body.stream_options and self.body.stream_options.include_usage:
                yield sse.event(self.envelope(self.chunk_object, []) | {"usage": usage(gens)})
        except APIError as e:
            yield sse.event(error_body("/v1", e.status, e.message, e.error_type))
        yield sse.event("[DONE]")

    async def _choice_chunks(self, index: int, gen: generation.Generation) -> AsyncIterator[dict]:
        choice, trimmer = self.choice(index), StopTrimmer(self.body.stops)
        pending: list[TokenEvent] = []  # tokens whose text is held back still owe their logprobs to the next chunk
        async for event in gen:
            if event.index == 0 and (lead := self.lead(choice, event)) is not None:
                yield lead
            pending.append(event)
            piece = trimmer.push(event)
            finish = OPENAI_FINISH[event.finish_reason] if event.finish_reason else None
            if (piece or finish) and (chunk := self.chunk(choice, piece, finish, pending)) is not None:
                yield chunk
                pending = []


class ChoiceText:
    """One choice of a reply, built chunk by chunk (delta) or at once (complete)."""

    def __init__(self, reply: Reply, index: int):
        self.reply, self.index = reply, index

    def delta(self, text: str | None, finish: str | None, events: list[TokenEvent]) -> dict | None:
        raise NotImplementedError

    def complete(self, text: str, finish: str, events: list[TokenEvent]) -> dict:
        raise NotImplementedError


class CompletionReply(Reply):
    object, chunk_object, prefix = "text_completion", "text_completion", "cmpl"

    def __init__(self, body: CompletionRequest, request: Request, tokenizer: Tokenizer, prompt_ids: list[int],
                 prompt_text: str):
        super().__init__(body, request, tokenizer)
        self.prompt_ids, self.prompt_text = prompt_ids, prompt_text

    def choice(self, index: int) -> "CompletionText":
        return CompletionText(self, index)

    def lead(self, choice: "CompletionText", first: TokenEvent) -> dict | None:
        return self.envelope(self.chunk_object, [choice.echo(first)]) if self.body.echo else None


class CompletionText(ChoiceText):
    reply: CompletionReply

    def __init__(self, reply: CompletionReply, index: int):
        super().__init__(reply, index)
        self.offset = len(reply.prompt_text) if reply.body.echo else 0  # where the next token's text starts

    def delta(self, text, finish, events, logprobs=None) -> dict:
        body = self.reply.body
        if logprobs is None and body.logprobs is not None and events:
            entries = generated_entries(events, self.reply.tokenizer)
            logprobs = completion_logprobs(entries, self.offset, body.top_alternatives)
            self.offset += sum(len(e.text) for e in events)
        return {"index": self.index, "text": text, "finish_reason": finish, "logprobs": logprobs}

    def echo(self, first: TokenEvent) -> dict:
        """The prompt as the choice's first piece of text, with its tokens' logprobs when asked."""
        reply = self.reply
        logprobs = None
        if reply.body.logprobs is not None:
            entries = prompt_entries(reply.prompt_ids, first, reply.tokenizer)
            logprobs = completion_logprobs(entries, 0, reply.body.top_alternatives)
        return self.delta(reply.prompt_text, None, [], logprobs)

    def complete(self, text, finish, events) -> dict:
        lead = self.echo(events[0]) if self.reply.body.echo else None
        choice = self.delta(text, finish, events)
        if lead is not None:  # the prompt's piece and the generated one, joined
            choice["text"] = lead["text"] + choice["text"]
            if lead["logprobs"] is not None:
                choice["logprobs"] = joined(lead["logprobs"], choice["logprobs"])
        return choice


class ChatReply(Reply):
    object, chunk_object, prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"

    def __init__(self, body: ChatCompletionRequest, request: Request, tokenizer: Tokenizer, prompt: Prompt):
        super().__init__(body, request, tokenizer)
        self.prompt, self.chat = prompt, prompt.chat

    def choice(self, index: int) -> "ChatText":
        return ChatText(self, index)


class ChatText(ChoiceText):
    """A chat choice. Its reasoning, where the model has some, goes out as `reasoning_content` (as vLLM and
    llama.cpp return it), apart from `content`. When the request offers tools, its text is held back to the end and
    read for tool calls: the calls go out as `tool_calls` (one delta when streaming), the rest as content, so a
    stream concatenates to the reply a request without `stream` gets."""

    reply: ChatReply

    def __init__(self, reply: ChatReply, index: int):
        super().__init__(reply, index)
        self.started = False  # the first delta carries the role
        self.held = ""  # the text held back, with tools (its tokens stay pending in the reply's loop)
        self.split = reply.prompt.reasoning()  # the streamed text's reasoning and answer, where it has reasoning

    def logprobs(self, events: list[TokenEvent]) -> dict | None:
        return chat_logprobs(events, self.reply.tokenizer) if self.reply.body.logprobs and events else None

    def delta(self, text, finish, events) -> dict | None:
        if self.reply.chat.calls_tools and text is not None:
            self.held += text
            if finish is None:
                return None  # the reply's loop keeps these tokens pending: at the end `events` holds them all
            message = self.message(self.held, finish)
            finish = message.pop("finish")
            delta = {k: v for k, v in message.items() if k != "role" and v is not None}
            if "tool_calls" in message:
                delta["tool_calls"] = [{"index": i} | call for i, call in enumerate(message["tool_calls"])]
        elif self.split is not None and text is not None:
            thought, said = self.split.take(text, finish is not None)
            delta = ({"reasoning_content": thought} if thought else {}) | ({"content": said} if said else {})
            if not delta and finish is None:
                return None  # all held back (the start of a tag): these tokens stay pending
        else:
            delta = {} if text is None else {"content": text}
        if not self.started and delta:
            delta, self.started = {"role": "assistant", **delta}, True
        return {"index": self.index, "delta": delta, "finish_reason": finish, "logprobs": self.logprobs(events)}

    def message(self, text: str, finish: str) -> dict:
        """The assistant message of a whole reply (with "finish", its finish reason): its reasoning apart, tool
        calls read from its answer."""
        thought, answer = self.reply.prompt.split(text)
        content, calls = self.reply.chat.reply(answer)
        message = {"role": "assistant", "content": content}
        if thought is not None:
            message["reasoning_content"] = thought
        if not calls:
            return message | {"finish": finish}
        return message | {"tool_calls": calls, "finish": "tool_calls" if finish == "stop" else finish}

    def complete(self, text, finish, events) -> dict:
        message = self.message(text, finish)
        finish = message.pop("finish")
        return {"index": self.index, "message": message, "logprobs": self.logprobs(events), "finish_reason": finish}


def sse_response(body) -> StreamingResponse:
    return StreamingResponse(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def answer(reply: Reply, gens: list[generation.Generation], request: Request):
    """Stream the reply, or wait for every choice and send it whole."""
    if reply.body.stream:
        return sse_response(reply.stream(gens))
    await generation.complete_all(gens, request)
    return JSONResponse(reply.whole(gens))


async def models(request: Request):
    runner = request.app.state.runner
    generation.ensure_ready(runner)
    return {"object": "list", "data": [{
        "id": model_name(request), "object": "model", "created": request.app.state.started, "owned_by": "kvserve",
        "max_model_len": runner.engine.max_seq_len}]}


async def completions(body: CompletionRequest, request: Request):
    runner = request.app.state.runner
    if isinstance(body.prompt, str):
        prompt_ids = await generation.tokenize_prompt(runner, body.prompt, body.parse_special)
        prompt_text = body.prompt
    else:  # token ids, as vLLM takes them: echoed as their text
        prompt_ids = generation.checked_token_ids(runner, body.prompt)
        prompt_text = runner.engine.tokenizer.decode(prompt_ids, skip_special_tokens=False)
    gens = await admit(body, request, prompt_ids, body.max_tokens, DEFAULT_COMPLETION_TOKENS)
    return await answer(CompletionReply(body, request, runner.engine.tokenizer, prompt_ids, prompt_text), gens, request)


async def chat_completions(body: ChatCompletionRequest, request: Request):
    runner = request.app.state.runner
    chat = generation.conversation(runner, request.app.state.settings, body.conversation)
    prompt = await generation.tokenize_conversation(runner, chat, body.parse_special)
    max_tokens = body.max_completion_tokens or body.max_tokens
    gens = await admit(body, request, prompt.ids, max_tokens, max(1, generation.room(runner, prompt.ids)), prompt)
    return await answer(ChatReply(body, request, runner.engine.tokenizer, prompt), gens, request)


def create_router() -> APIRouter:
    router = APIRouter(prefix="/v1")
    router.add_api_route("/models", models, methods=["GET"])
    router.add_api_route("/completions", completions, methods=["POST"])
    router.add_api_route("/chat/completions", chat_completions, methods=["POST"])
    return router
