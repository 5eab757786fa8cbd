"""OpenAI's Responses API: POST /v1/responses (whole or streamed), GET and DELETE /v1/responses/{id}.

The request is a Conversation (server/responses_schemas.py), continued from a stored response when it names
previous_response_id (server/response_store.py), and admitted as every chat route's is (server/generation.py);
what is the Responses API's own is here: the response object, its output items (message, function_call), usage,
and the stream's events (response.created ... response.completed, each with its sequence_number)."""

from __future__ import annotations

import time
import uuid
from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine import FinishReason
from server import generation, sse
from server.conversation import Prompt, Turn
from server.errors import APIError, error_body
from server.reasoning import Reasoning
from server.response_store import ResponseStore, StoredResponse
from server.responses_schemas import NamedFunction, ResponsesRequest


EMPTY_TEXT = {"type": "output_text", "text": "", "annotations": []}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseReply:
    """The response a request gets: whole (`whole`) or as the Responses API's stream events (`stream`), and the
    conversation it ends, for the store. When the request offers tools, the text is held back to the end and
    read for calls, which become function_call items after the message's, so that a stream's items are the whole
    response's."""

    def __init__(self, body: ResponsesRequest, prompt: Prompt, history: tuple[Turn, ...], model: str):
        self.body, self.prompt, self.chat, self.history, self.model = body, prompt, prompt.chat, history, model
        self.id, self.message_id, self.reasoning_id = new_id("resp"), new_id("msg"), new_id("rs")
        self.created = int(time.time())
        self.sequence = 0

    def envelope(self, status: str, output: list[dict], gen: generation.Generation | None = None) -> dict:
        body = self.body
        form = body.text.format if body.text and body.text.format else None
        text_format = form.model_dump(by_alias=True, exclude_none=True) if form else {"type": "text"}
        choice = body.tool_choice
        choice = choice.model_dump() if isinstance(choice, NamedFunction) else choice or "auto"
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "model": self.model,
            "output": output, "output_text": "".join(p["text"] for item in output if item["type"] == "message"
                                                     for p in item["content"]),
            "error": None, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "temperature": body.temperature, "top_p": body.top_p,
            "tools": [t.model_dump(exclude_none=True) for t in body.function_tools], "tool_choice": choice,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "store": body.store, "text": {"format": text_format}, "metadata": body.metadata or {},
            "truncation": "disabled", "reasoning": {"effort": None, "summary": None},
            "usage": self.usage(gen) if gen is not None else None,
        }

    @staticmethod
    def usage(gen: generation.Generation) -> dict:
        prompt, output = len(gen.stream.prompt_ids), len(gen.events)
        proposed, accepted = gen.draft_tokens
        # Speculative decoding's drafts beside reasoning_tokens: an extension, as Chat Completions' prediction fields.
        return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": gen.reused_prompt_tokens},
                "output_tokens": output,
                "output_tokens_details": {"reasoning_tokens": 0, "accepted_prediction_tokens": accepted,
                                          "rejected_prediction_tokens": proposed - accepted},
                "total_tokens": prompt + output}

    @staticmethod
    def status(gen: generation.Generation) -> str:
        return "incomplete" if gen.events[-1].finish_reason == FinishReason.LENGTH else "completed"

    def message(self, text: str, status: str) -> dict:
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": []}]}

    def thought(self, text: str) -> dict:
        return {"type": "reasoning", "id": self.reasoning_id, "summary": [],
                "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}

    def items(self, text: str, status: str) -> list[dict]:
        """The output items: the reasoning (where there is some), the message (unless it would be empty beside
        them), then a function_call per call."""
        thought, answer = self.prompt.split(text)
        content, calls = self.chat.reply(answer)
        items = [self.thought(thought)] if thought else []
        items += [self.message(content or "", status)] if content or not (calls or thought) else []
        return items + [{"type": "function_call", "id": f"fc_{call['id'].removeprefix('call_')}",
                         "call_id": call["id"], "name": call["function"]["name"],
                         "arguments": call["function"]["arguments"], "status": "completed"} for call in calls]

    def finished(self, gen: generation.Generation, store: ResponseStore) -> dict:
        """The whole response, kept in the store with its conversation when the request asked to store it."""
        status = self.status(gen)
        output = self.items(generation.trimmed_text(gen.events, ()), status)
        response = self.envelope(status, output, gen)
        if self.body.store:
            calls = tuple({"id": i["call_id"], "type": "function",
                           "function": {"name": i["name"], "arguments": i["arguments"]}}
                          for i in output if i["type"] == "function_call")
            reply = Turn("assistant", response["output_text"], calls)
            store.put(self.id, StoredResponse(response, (*self.history, *self.body.turns(), reply)))
        return response

    def event(self, kind: str, **fields) -> bytes:
        """One stream event, named by its type, numbered in order."""
        data = {"type": kind, "sequence_number": self.sequence} | fields
        self.sequence += 1
        return sse.event(data, name=kind)

    async def stream(self, gen: generation.Generation, store: ResponseStore) -> AsyncIterator[bytes]:
        """The response's events. Without tools, the reasoning item and the message stream as the text comes;
        the items not streamed so (all of them with tools) go out whole at the end."""
        yield self.event("response.created", response=self.envelope("in_progress", []))
        yield self.event("response.in_progress", response=self.envelope("in_progress", []))
        split = None if self.chat.calls_tools else self.prompt.reasoning()
        streamed: list[dict] = []  # the items streamed so far, as they started; the last one is open
        try:
            async for event in gen:
                if self.chat.calls_tools:
                    continue  # held back: the items go out whole at the end
                for item, piece in self.pieces(split, event.text, done=event.finish_reason is not None):
                    if not streamed or streamed[-1]["type"] != item["type"]:
                        if streamed:
                            for kind, fields in closing(len(streamed) - 1, self.thought(split.reasoning)):
                                yield self.event(kind, **fields)  # only reasoning comes before more
                        streamed.append(item)
                        for kind, fields in opening(len(streamed) - 1, item):
                            yield self.event(kind, **fields)
                    kind, fields = growing(len(streamed) - 1, item, piece)
                    yield self.event(kind, **fields)
            response = self.finished(gen, store)
            output = response["output"]
            if streamed:
                for kind, fields in closing(len(streamed) - 1, output[len(streamed) - 1]):
                    yield self.event(kind, **fields)
            for index in range(len(streamed), len(output)):
                for kind, fields in whole_item(index, output[index]):
                    yield self.event(kind, **fields)
            yield self.event(f"response.{response['status']}", response=response)
        except APIError as e:
            yield self.event("error", **error_body("/v1", e.status, e.message, e.error_type)["error"])

    def pieces(self, split: Reasoning | None, piece: str, done: bool) -> list[tuple[dict, str]]:
        """A new piece of text as (the item it belongs to, as it starts; its text): reasoning, then message."""
        if split is None:
            return [(self.message("", "in_progress"), piece)] if piece else []
        thought, said = split.take(piece, done)
        return [(item, text) for item, text in ((self.thought(""), thought), (self.message("", "in_progress"), said))
                if text]


def opening(index: int, item: dict) -> list[tuple[str, dict]]:
    """An item's first events: added (empty), and a message's empty text part."""
    events = [("response.output_item.added", {"output_index": index, "item": item | {"status": "in_progress",
                                                                                    "content": []}})]
    if item["type"] == "message":
        events.append(("response.content_part.added", {"item_id": item["id"], "output_index": index,
                                                       "content_index": 0, "part": EMPTY_TEXT}))
    return events


def growing(index: int, item: dict, text: str) -> tuple[str, dict]:
    """A piece of an item's text: an output_text or a reasoning_text delta."""
    kind = "response.output_text.delta" if item["type"] == "message" else "response.reasoning_text.delta"
    fields = {"item_id": item["id"], "output_index": index, "content_index": 0, "delta": text}
    return kind, fields | ({"logprobs": []} if item["type"] == "message" else {})


def closing(index: int, item: dict) -> list[tuple[str, dict]]:
    """An item's last events, with its whole text: the text's done (and a message's part's), then the item's."""
    part = {"item_id": item["id"], "output_index": index, "content_index": 0}
    if item["type"] == "message":
        events = [("response.output_text.done", part | {"text": item["content"][0]["text"], "logprobs": []}),
                  ("response.content_part.done", part | {"part": item["content"][0]})]
    elif item["type"] == "reasoning":
        events = [("response.reasoning_text.done", part | {"text": item["content"][0]["text"]})]
    else:
        events = [("response.function_call_arguments.done", {"item_id": item["id"], "output_index": index,
                                                             "arguments": item["arguments"], "name": item["name"]})]
    return events + [("response.output_item.done", {"output_index": index, "item": item})]


def whole_item(index: int, item: dict) -> list[tuple[str, dict]]:
    """A finished item not streamed as it came: opened, its text or arguments in one delta, closed."""
    if item["type"] == "function_call":
        started = item | {"arguments": "", "status": "in_progress"}
        middle = [("response.function_call_arguments.delta", {"item_id": item["id"], "output_index": index,
                                                              "delta": item["arguments"]})]
        return [("response.output_item.added", {"output_index": index, "item": started}), *middle,
                *closing(index, item)]
    text = item["content"][0]["text"]
    return [*opening(index, item), *([growing(index, item, text)] if text else []), *closing(index, item)]


def stored(request: Request, response_id: str) -> StoredResponse:
    found = request.app.state.responses.get(response_id)
    if found is None:
        raise APIError(404, f"Response with id '{response_id}' not found (never stored, deleted, or evicted: the "
                            "server keeps --responses-store of them)", "not_found")
    return found


async def create(body: ResponsesRequest, request: Request):
    runner, metrics, settings = request.app.state.runner, request.app.state.metrics, request.app.state.settings
    history = stored(request, body.previous_response_id).turns if body.previous_response_id else ()
    chat = generation.conversation(runner, settings, lambda form: body.conversation(history, form))
    prompt = await generation.tokenize_conversation(runner, chat, parse_special=False)
    default = max(1, generation.room(runner, prompt.ids))
    (gen,) = await generation.admit(runner, metrics, prompt.ids, lambda: body.sampling(default, prompt))
    reply = ResponseReply(body, prompt, history, body.model or settings.served_model_name)
    if body.stream:
        return StreamingResponse(reply.stream(gen, request.app.state.responses), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    await gen.complete(request)
    return JSONResponse(reply.finished(gen, request.app.state.responses))


async def retrieve(response_id: str, request: Request):
    return stored(request, response_id).response


async def delete(response_id: str, request: Request):
    stored(request, response_id)
    request.app.state.responses.delete(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


def create_router() -> APIRouter:
    router = APIRouter(prefix="/v1")
    router.add_api_route("/responses", create, methods=["POST"])
    router.add_api_route("/responses/{response_id}", retrieve, methods=["GET"])
    router.add_api_route("/responses/{response_id}", delete, methods=["DELETE"])
    return router
