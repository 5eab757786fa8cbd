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
from server.conversation import Conversation
from server.errors import APIError, error_body
from server.generation import StopTrimmer
from server.messages_schemas import CountTokensRequest, MessagesRequest

STOP_REASONS = {FinishReason.LENGTH: "max_tokens", FinishReason.EOS: "end_turn", FinishReason.STOP: "stop_sequence",
                FinishReason.ABORT: "end_turn"}


class MessageReply:
    """The assistant message a request gets: whole (`whole`) or as Anthropic's stream events (`stream`). When the
    request offers tools, the text is held back to the end and read for calls, which become tool_use blocks
    after the text's block, so that a stream's blocks are the whole reply's."""

    def __init__(self, body: MessagesRequest, chat: Conversation):
        self.body, self.chat = body, chat
        self.id = f"msg_{uuid.uuid4().hex[:24]}"

    @property
    def head(self) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.body.model}

    @staticmethod
    def usage(gen: generation.Generation) -> dict:
        """Anthropic counts prompt tokens read from its cache apart from the rest: here those whose K/V a slot kept."""
        cached = gen.reused_prompt_tokens
        return {"input_tokens": len(gen.stream.prompt_ids) - cached, "output_tokens": len(gen.events),
                "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}

    def blocks(self, text: str) -> list[dict]:
        """The reply's content blocks: its text (unless calls are all there is), then a tool_use per call."""
        content, calls = self.chat.reply(text)
        blocks = [{"type": "text", "text": content}] if content or not calls else []
        return blocks + [{"type": "tool_use", "id": f"toolu_{call['id'].removeprefix('call_')}",
                          "name": call["function"]["name"], "input": json.loads(call["function"]["arguments"])}
                         for call in calls]

    def stop(self, gen: generation.Generation, blocks: list[dict]) -> dict:
        last = gen.events[-1]
        reason = "tool_use" if any(b["type"] == "tool_use" for b in blocks) else STOP_REASONS[last.finish_reason]
        return {"stop_reason": reason, "stop_sequence": last.stop_string if reason == "stop_sequence" else None}

    def whole(self, gen: generation.Generation) -> dict:
        text = generation.trimmed_text(gen.events, self.body.stops)
        blocks = self.blocks(text)
        return self.head | {"content": blocks} | self.stop(gen, blocks) | {"usage": self.usage(gen)}

    async def stream(self, gen: generation.Generation) -> AsyncIterator[bytes]:
        """message_start, the blocks' events, message_delta (stop reason, usage), message_stop; an error after the
        stream began as an `error` event, which ends it."""
        trimmer, held, opened = StopTrimmer(self.body.stops), "", False
        try:
            async for event in gen:
                if event.index == 0:
                    start = self.head | {"content": [], "stop_reason": None, "stop_sequence": None,
                                              "usage": self.usage(gen) | {"output_tokens": 0}}
                    yield named({"type": "message_start", "message": start})
                    if not self.chat.calls_tools:
                        yield named(block_start(0, {"type": "text", "text": ""}))
                        opened = True
                    yield named({"type": "ping"})
                piece = trimmer.push(event)
                if self.chat.calls_tools:
                    held += piece
                elif piece:
                    yield named({"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "text_delta", "text": piece}})
            if opened:
                blocks = [{"type": "text"}]
                yield named({"type": "content_block_stop", "index": 0})
            else:  # held back: every block now, each a start, one delta and a stop
                blocks = self.blocks(held)
                for index, block in enumerate(blocks):
                    for item in block_events(index, block):
                        yield named(item)
            yield named({"type": "message_delta", "delta": self.stop(gen, blocks),
                         "usage": self.usage(gen)})
            yield named({"type": "message_stop"})
        except APIError as e:
            yield named(error_body("/v1/messages", e.status, e.message, e.error_type))


def named(data: dict) -> bytes:
    """An Anthropic stream event: its `event:` name is its type."""
    return sse.event(data, name=data["type"])


def block_start(index: int, block: dict) -> dict:
    return {"type": "content_block_start", "index": index, "content_block": block}


def block_events(index: int, block: dict) -> list[dict]:
    """A whole block as stream events: a text block's text in one text_delta, a tool_use block's input in one
    input_json_delta (the block starts with an empty input, as Anthropic's do)."""
    if block["type"] == "text":
        start, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
    else:
        start = block | {"input": {}}
        delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}
    return [block_start(index, start), {"type": "content_block_delta", "index": index, "delta": delta},
            {"type": "content_block_stop", "index": index}]


async def conversation_ids(body: CountTokensRequest, request: Request) -> tuple[Conversation, list[int]]:
    runner = request.app.state.runner
    chat = generation.conversation(runner, request.app.state.settings.tool_call_parser, body.conversation)
    return chat, await generation.tokenize_conversation(runner, chat, parse_special=False)


async def messages(body: MessagesRequest, request: Request):
    runner, metrics = request.app.state.runner, request.app.state.metrics
    chat, prompt_ids = await conversation_ids(body, request)
    (gen,) = await generation.admit(runner, metrics, prompt_ids, lambda: body.sampling(chat))
    reply = MessageReply(body, chat)
    if body.stream:
        return StreamingResponse(reply.stream(gen), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    await gen.complete(request)
    return JSONResponse(reply.whole(gen))


async def count_tokens(body: CountTokensRequest, request: Request):
    _, prompt_ids = await conversation_ids(body, request)
    return {"input_tokens": len(prompt_ids)}


def create_router() -> APIRouter:
    router = APIRouter(prefix="/v1")
    router.add_api_route("/messages", messages, methods=["POST"])
    router.add_api_route("/messages/count_tokens", count_tokens, methods=["POST"])
    return router
