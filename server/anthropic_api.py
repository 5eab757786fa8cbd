"""Anthropic's Messages API: POST /v1/messages (whole or streamed) and /v1/messages/count_tokens.

The request is a Conversation (server/messages_schemas.py) admitted as every chat route's is
(server/generation.py); what is Anthropic's own is here: the message object, its content blocks, stop reasons and
usage, and the named stream events (message_start, content_block_start/delta/stop, message_delta, message_stop)."""

from __future__ import annotations

import json
import uuid
from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine import FinishReason
from server import generation, sse
from server.conversation import Prompt
from server.errors import APIError, error_body
from server.generation import StopTrimmer
from server.messages_schemas import CountTokensRequest, MessagesRequest
from server.reasoning import Reasoning

STOP_REASONS = {FinishReason.LENGTH: "max_tokens", FinishReason.EOS: "end_turn", FinishReason.STOP: "stop_sequence",
                FinishReason.ABORT: "end_turn"}


class MessageReply:
    """The assistant message a request gets: whole (`whole`) or as Anthropic's stream events (`stream`). The
    model's reasoning, where it has some, is a thinking block before the rest. When the request offers tools, the
    text is held back to the end and read for calls, which become tool_use blocks after the text's block, so that
    a stream's blocks are the whole reply's."""

    def __init__(self, body: MessagesRequest, prompt: Prompt):
        self.body, self.prompt, self.chat = body, prompt, prompt.chat
        self.id = f"msg_{uuid.uuid4().hex[:24]}"

    @property
    def head(self) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.body.model}

    @staticmethod
    def usage(gen: generation.Generation) -> dict:
        """Anthropic counts prompt tokens read from its cache apart from the rest: here those whose K/V a slot kept.
        Speculative decoding's drafts (verified, and kept) are an extension, named as in TGI's details."""
        cached, (proposed, accepted) = gen.reused_prompt_tokens, gen.draft_tokens
        return {"input_tokens": len(gen.stream.prompt_ids) - cached, "output_tokens": len(gen.events),
                "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0,
                "draft_tokens": proposed, "accepted_draft_tokens": accepted}

    def blocks(self, text: str) -> list[dict]:
        """The reply's content blocks: its reasoning, its text (unless it would be empty beside them), a tool_use
        per call."""
        thought, answer = self.prompt.split(text)
        content, calls = self.chat.reply(answer)
        blocks = [{"type": "thinking", "thinking": thought, "signature": ""}] if thought else []
        blocks += [{"type": "text", "text": content or ""}] if content or not (calls or thought) else []
        return blocks + [{"type": "tool_use", "id": f"toolu_{call['id'].removeprefix('call_')}",
                          "name": call["function"]["name"], "input": json.loads(call["function"]["arguments"])}
                         for call in calls]

    def stop(self, gen: generation.Generation, blocks: list[dict]) -> dict:
        last = gen.events[-1]
        reason = "tool_use" if any(b["type"] == "tool_use" for b in blocks) else STOP_REASONS[last.finish_reason]
        return {"stop_reason": reason, "stop_sequence": last.stop_string if reason == "stop_sequence" else None}

    def whole(self, gen: generation.Generation) -> dict:
        blocks = self.blocks(generation.trimmed_text(gen.events, self.body.stops))
        return self.head | {"content": blocks} | self.stop(gen, blocks) | {"usage": self.usage(gen)}

    async def stream(self, gen: generation.Generation) -> AsyncIterator[bytes]:
        """message_start, the blocks' events, message_delta (stop reason, usage), message_stop; an error after the
        stream began as an `error` event, which ends it. Without tools, the thinking and text blocks stream as the
        text comes; the blocks not streamed so (all of them with tools) go out whole at the end."""
        trimmer, text = StopTrimmer(self.body.stops), ""
        split = None if self.chat.calls_tools else self.prompt.reasoning()
        streamed: list[str] = []  # the types of the blocks streamed so far; the last one is open
        try:
            async for event in gen:
                if event.index == 0:
                    start = self.head | {"content": [], "stop_reason": None, "stop_sequence": None,
                                         "usage": self.usage(gen) | {"output_tokens": 0}}
                    yield named({"type": "message_start", "message": start})
                    yield named({"type": "ping"})
                piece = trimmer.push(event)
                text += piece
                if self.chat.calls_tools:
                    continue
                for kind, said in pieces(split, piece, done=event.finish_reason is not None):
                    if not streamed or streamed[-1] != kind:
                        if streamed:
                            yield named({"type": "content_block_stop", "index": len(streamed) - 1})
                        streamed.append(kind)
                        yield named(block_start(len(streamed) - 1, EMPTY[kind]))
                    yield named({"type": "content_block_delta", "index": len(streamed) - 1, "delta": delta(kind, said)})
            if streamed:
                yield named({"type": "content_block_stop", "index": len(streamed) - 1})
            blocks = self.blocks(text)
            for index in range(len(streamed), len(blocks)):  # each a start, one delta and a stop
                for item in block_events(index, blocks[index]):
                    yield named(item)
            yield named({"type": "message_delta", "delta": self.stop(gen, blocks), "usage": self.usage(gen)})
            yield named({"type": "message_stop"})
        except APIError as e:
            yield named(error_body("/v1/messages", e.status, e.message, e.error_type))


EMPTY = {"thinking": {"type": "thinking", "thinking": "", "signature": ""}, "text": {"type": "text", "text": ""}}


def pieces(split: Reasoning | None, piece: str, done: bool) -> list[tuple[str, str]]:
    """A new piece of text as (block type, text) pairs: reasoning in "thinking", the answer in "text"."""
    if split is None:
        return [("text", piece)] if piece else []
    thought, said = split.take(piece, done)
    return [(kind, t) for kind, t in (("thinking", thought), ("text", said)) if t]


def delta(kind: str, text: str) -> dict:
    return {"type": "thinking_delta", "thinking": text} if kind == "thinking" else {"type": "text_delta", "text": text}


def named(data: dict) -> bytes:
    """An Anthropic stream event: its `event:` name is its type."""
    return sse.event(data, name=data["type"])


def block_start(index: int, block: dict) -> dict:
    return {"type": "content_block_start", "index": index, "content_block": block}


def block_events(index: int, block: dict) -> list[dict]:
    """A whole block as stream events: its start (empty), its content in one delta (thinking_delta, text_delta or
    a tool_use's input as input_json_delta), its stop."""
    if block["type"] == "tool_use":
        start = block | {"input": {}}
        content = {"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}
    else:
        start, content = EMPTY[block["type"]], delta(block["type"], block[block["type"]])
    return [block_start(index, start), {"type": "content_block_delta", "index": index, "delta": content},
            {"type": "content_block_stop", "index": index}]


async def prompt_of(body: CountTokensRequest, request: Request) -> Prompt:
    runner = request.app.state.runner
    chat = generation.conversation(runner, request.app.state.settings, body.conversation)
    return await generation.tokenize_conversation(runner, chat, parse_special=False)


async def messages(body: MessagesRequest, request: Request):
    runner, metrics = request.app.state.runner, request.app.state.metrics
    prompt = await prompt_of(body, request)
    room = generation.room(runner, prompt.ids)
    (gen,) = await generation.admit(runner, metrics, prompt.ids, lambda: body.sampling(prompt, room))
    reply = MessageReply(body, prompt)
    if body.stream:
        return StreamingResponse(reply.stream(gen), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    await gen.complete(request)
    return JSONResponse(reply.whole(gen))


async def count_tokens(body: CountTokensRequest, request: Request):
    return {"input_tokens": len((await prompt_of(body, request)).ids)}


def create_router() -> APIRouter:
    router = APIRouter(prefix="/v1")
    router.add_api_route("/messages", messages, methods=["POST"])
    router.add_api_route("/messages/count_tokens", count_tokens, methods=["POST"])
    return router
