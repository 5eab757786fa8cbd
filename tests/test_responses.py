"""OpenAI's Responses API (/v1/responses) through the real `openai` SDK, against the real server on a tiny model."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from server.conversation import Turn
from server.response_store import ResponseStore, StoredResponse
from tests.server_harness import serve
from tests.test_tools import SCHEMAS, WEATHER

TOOL = {"type": "function", "name": "get_weather", "description": WEATHER["function"]["description"],
        "parameters": WEATHER["function"]["parameters"]}
QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def server(model_dir):
    with serve(model_dir("long"), max_seq_len=2048) as running:  # the tools preamble is long in tiny tokens
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def chat(server, messages: list[dict], **body) -> dict:
    """The same conversation through /v1/chat/completions: the one generation path both routes share."""
    reply = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": messages, "temperature": 0} | body,
                       timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_a_response_is_the_chat_routes_reply_in_the_responses_shape(server, client):
    response = client.responses.create(model="kvserve", input=QUESTION, instructions="Answer briefly.",
                                       max_output_tokens=12, temperature=0)
    same = chat(server, [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": QUESTION}],
                max_tokens=12)
    assert response.object == "response" and response.id.startswith("resp_")
    assert [item.type for item in response.output] == ["message"]
    assert response.output_text == same["choices"][0]["message"]["content"]
    finish = same["choices"][0]["finish_reason"]
    assert response.status == {"length": "incomplete", "stop": "completed"}[finish]
    if finish == "length":
        assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.input_tokens == same["usage"]["prompt_tokens"]
    assert response.usage.output_tokens == same["usage"]["completion_tokens"]
    # The chat request after it found the prompt's K/V kept, as the same response again does.
    again = client.responses.create(model="kvserve", input=QUESTION, instructions="Answer briefly.",
                                    max_output_tokens=12, temperature=0)
    assert again.usage.input_tokens_details.cached_tokens == same["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_a_stream_numbers_its_events_and_adds_up_to_the_response(client):
    ask = dict(model="kvserve", input=[{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}],
               max_output_tokens=16, temperature=0)
    whole = client.responses.create(**ask)
    events = list(client.responses.create(**ask, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{whole.status}"]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


def test_a_required_call_streamed_or_not_then_its_output_continues_the_conversation(server, client):
    ask = dict(model="kvserve", input=QUESTION, tools=[TOOL], tool_choice="required", parallel_tool_calls=False,
               max_output_tokens=300, temperature=0)
    response = client.responses.create(**ask)
    assert response.status == "completed" and [item.type for item in response.output] == ["function_call"]
    call = response.output[0]
    jsonschema.validate(json.loads(call.arguments), SCHEMAS["get_weather"])
    with client.responses.stream(**ask) as stream:
        final = stream.get_final_response()
    assert [(i.type, i.name, i.arguments) for i in final.output] == [("function_call", call.name, call.arguments)]
    # The call's output goes back with previous_response_id: the stored conversation, then the output.
    after = client.responses.create(model="kvserve", previous_response_id=response.id, tools=[TOOL], tool_choice="none",
                                    input=[{"type": "function_call_output", "call_id": call.call_id,
                                            "output": "18 degrees, sunny"}], max_output_tokens=4, temperature=0)
    same = chat(server, [{"role": "user", "content": QUESTION},
                         {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function",
                          "function": {"name": call.name, "arguments": call.arguments}}]},
                         {"role": "tool", "tool_call_id": call.call_id, "content": "18 degrees, sunny"}],
                max_tokens=4, tools=[WEATHER], tool_choice="none")
    assert after.output_text == same["choices"][0]["message"]["content"]
    assert after.usage.input_tokens == same["usage"]["prompt_tokens"]


def test_previous_response_id_continues_a_conversation_and_retrieve_and_delete_work(server, client):
    first = client.responses.create(model="kvserve", input="Hello there", max_output_tokens=6, temperature=0)
    second = client.responses.create(model="kvserve", previous_response_id=first.id, input="And then?",
                                     max_output_tokens=6, temperature=0)
    same = chat(server, [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": first.output_text},
                         {"role": "user", "content": "And then?"}], max_tokens=6)
    assert second.output_text == same["choices"][0]["message"]["content"]
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == same["usage"]["prompt_tokens"]
    kept = client.responses.retrieve(first.id)
    assert (kept.id, kept.output_text) == (first.id, first.output_text)
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="kvserve", previous_response_id=first.id, input="More", max_output_tokens=2)
    unstored = client.responses.create(model="kvserve", input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


CITY = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "sunny": {"type": "boolean"}},
        "required": ["name", "sunny"], "additionalProperties": False}


class City(BaseModel):
    name: str = Field(max_length=12)
    sunny: bool


def test_a_json_schema_format_is_enforced_and_parsed(client):
    parsed = client.responses.parse(model="kvserve", input=QUESTION, text_format=City, max_output_tokens=200,
                                    temperature=1.0)
    assert isinstance(parsed.output_parsed, City)
    response = client.responses.create(model="kvserve", input=QUESTION, max_output_tokens=200, temperature=1.0,
                                       text={"format": {"type": "json_schema", "name": "city", "strict": True,
                                                        "schema": CITY}})
    jsonschema.validate(json.loads(response.output_text), CITY)


@pytest.mark.parametrize("body,status,says", [
    ({"input": QUESTION, "previous_response_id": "resp_nope"}, 404, "not found"),
    ({"input": ""}, 400, "input"),
    ({"input": QUESTION, "tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, 400, "not among the tools"),
    ({"input": QUESTION, "tool_choice": "required"}, 400, "needs tools"),
    ({"input": [{"type": "reasoning", "summary": []}]}, 400, "no message"),
])
def test_bad_requests_get_openais_error_shape(server, body, status, says):
    response = httpx.post(f"{server.url}/v1/responses", json={"model": "kvserve"} | body, timeout=60)
    assert response.status_code == status, response.text
    assert response.json()["error"]["type"] == "invalid_request_error" and says in response.json()["error"]["message"]


def test_fields_codex_sends_are_ignored_and_hosted_tools_left_out(server):
    body = {"model": "kvserve", "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
            "max_output_tokens": 3, "temperature": 0, "store": False, "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": "k", "reasoning": {"effort": "low", "summary": "auto"}, "parallel_tool_calls": True,
            "tools": [TOOL, {"type": "web_search"}], "tool_choice": "auto"}
    response = httpx.post(f"{server.url}/v1/responses", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert [t["name"] for t in response.json()["tools"]] == ["get_weather"]


def test_the_store_evicts_the_oldest_past_its_count_or_its_bytes():
    def entry(text: str) -> StoredResponse:
        return StoredResponse({"id": text}, (Turn("user", text),))

    store = ResponseStore(max_count=2, max_bytes=10_000)
    for name in ("a", "b", "c"):
        assert store.put(name, entry(name))
    assert store.get("a") is None and store.get("b") and store.get("c")
    small = ResponseStore(max_count=100, max_bytes=2 * entry("x" * 100).size)
    for name in ("1", "2", "3"):
        assert small.put(name, entry(name * 100))
    assert small.get("1") is None and small.get("2") and small.get("3")
    assert small.bytes <= small.max_bytes
    assert not small.put("big", entry("y" * 1000)) and small.get("big") is None  # alone over the budget: not kept
    assert not ResponseStore(max_count=0, max_bytes=10_000).put("a", entry("a"))


def test_the_server_keeps_only_responses_store_of_them(model_dir):
    with serve(model_dir("long"), responses_store=2) as running:
        client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0)
        ids = [client.responses.create(model="kvserve", input=f"Hi {i}", max_output_tokens=2).id for i in range(3)]
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(ids[0])
        assert [client.responses.retrieve(i).id for i in ids[1:]] == ids[1:]
