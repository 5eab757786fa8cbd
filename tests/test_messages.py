"""Anthropic's Messages API (/v1/messages) through the real `anthropic` SDK, against the real server on a tiny model."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from tests.server_harness import serve
from tests.test_tools import CLOCK, SCHEMAS, WEATHER

TOOLS = [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
          "input_schema": t["function"]["parameters"]} for t in (WEATHER, CLOCK)]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SYSTEM = "You answer in one word."
# The current SDK has no temperature argument any more (older clients send one): greedy, through the body.
GREEDY = {"extra_body": {"temperature": 0}}


@pytest.fixture(scope="module")
def server(model_dir):
    with serve(model_dir("long"), max_seq_len=2048) as running:  # the tools preamble is long in tiny tokens
        yield running


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def chat(server, **body) -> dict:
    """The same conversation through /v1/chat/completions: the one generation path both routes share."""
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=body | {"temperature": 0}, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_a_reply_is_the_chat_routes_reply_in_anthropics_shape(server, client):
    reply = client.messages.create(model="kvserve", max_tokens=12, system=SYSTEM, messages=ASK, **GREEDY)
    same = chat(server, messages=[{"role": "system", "content": SYSTEM}, *ASK], max_tokens=12)
    assert reply.type == "message" and reply.role == "assistant" and reply.model == "kvserve"
    assert [b.type for b in reply.content] == ["text"]
    assert reply.content[0].text == same["choices"][0]["message"]["content"]
    assert reply.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[same["choices"][0]["finish_reason"]]
    assert reply.usage.output_tokens == same["usage"]["completion_tokens"]
    # Prompt tokens whose K/V a slot kept are counted apart, as Anthropic counts cache reads.
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == same["usage"]["prompt_tokens"]


def test_a_stream_gives_the_whole_replys_message_and_anthropics_events(server, client):
    ask = dict(model="kvserve", max_tokens=16, messages=ASK, **GREEDY)
    whole = client.messages.create(**ask)
    with client.messages.stream(**ask) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert (final.stop_reason, final.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)
    raw = {"model": "kvserve", "max_tokens": 16, "messages": ASK, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/messages", json=raw, timeout=120) as response:
        names = [line.removeprefix("event: ") for line in response.iter_lines() if line.startswith("event: ")]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert set(names[3:-3]) == {"content_block_delta"} and names[-3:] == ["content_block_stop", "message_delta",
                                                                          "message_stop"]


def test_a_stop_sequence_ends_the_text_before_it_and_is_named(server, client):
    ask = dict(model="kvserve", messages=ASK, **GREEDY)
    full = client.messages.create(**ask, max_tokens=24).content[0].text
    # Two letters from the text (a random model's text holds replacement characters, whose bytes may be split
    # differently as the text grows).
    stop = next((full[i:i + 2] for i in range(1, len(full) - 2) if full[i:i + 2].isascii() and full[i:i + 2].isalnum()), None)
    if stop is None:
        pytest.skip("this random model's text has no two letters in a row to stop at")
    reply = client.messages.create(**ask, max_tokens=24, stop_sequences=[stop])
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == stop
    assert reply.content[0].text == full[:full.index(stop)]
    # The whole text is the stream's on the OpenAI route too (one trimmer over all the tokens, not one per token).
    same = chat(server, messages=ASK, max_tokens=24, stop=[stop])
    assert same["choices"][0]["message"]["content"] == full[:full.index(stop)]


def test_count_tokens_counts_the_prompt_the_reply_is_generated_from(server, client):
    counted = client.messages.count_tokens(model="kvserve", system=SYSTEM, messages=ASK, tools=TOOLS)
    same = chat(server, messages=[{"role": "system", "content": SYSTEM}, *ASK], max_tokens=1,
                tools=[WEATHER, CLOCK])
    assert counted.input_tokens == same["usage"]["prompt_tokens"]


def test_a_required_call_is_a_valid_tool_use_block_streamed_or_not(client):
    for seed_choice in ({"type": "any"}, {"type": "tool", "name": "get_time"}):
        ask = dict(model="kvserve", max_tokens=300, messages=ASK, tools=TOOLS, **GREEDY,
                   tool_choice=seed_choice | {"disable_parallel_tool_use": True})
        reply = client.messages.create(**ask)
        assert reply.stop_reason == "tool_use" and [b.type for b in reply.content] == ["tool_use"]
        call = reply.content[0]
        jsonschema.validate(call.input, SCHEMAS[call.name])
        assert seed_choice["type"] == "any" or call.name == "get_time"
        assert call.id.startswith("toolu_")
        with client.messages.stream(**ask) as stream:
            final = stream.get_final_message()
        assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", call.name, call.input)]
        assert final.stop_reason == "tool_use"
        # The result goes back as a tool_result block, and the conversation goes on.
        history = ASK + [{"role": "assistant", "content": [b.model_dump() for b in reply.content]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                       "content": "18 degrees, sunny"}]}]
        after = client.messages.create(model="kvserve", max_tokens=4, messages=history, tools=TOOLS,
                                       tool_choice={"type": "none"}, **GREEDY)
        assert after.content[0].type == "text"
        longer = client.messages.count_tokens(model="kvserve", messages=history, tools=TOOLS)
        shorter = client.messages.count_tokens(model="kvserve", messages=history[:2], tools=TOOLS)
        assert longer.input_tokens > shorter.input_tokens  # the result reached the prompt


def test_a_tool_result_renders_as_the_chat_routes_tool_turn(server, client):
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris", "unit": "celsius"}}
    history = ASK + [{"role": "assistant", "content": [call]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                   "content": [{"type": "text", "text": "18 degrees"}]}]}]
    counted = client.messages.count_tokens(model="kvserve", messages=history, tools=TOOLS)
    openai_history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "toolu_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps(call["input"])}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18 degrees"}]
    same = chat(server, messages=openai_history, max_tokens=1, tools=[WEATHER, CLOCK])
    assert counted.input_tokens == same["usage"]["prompt_tokens"]


@pytest.mark.parametrize("body,says", [
    ({"messages": ASK}, "max_tokens"),
    ({"max_tokens": 4, "messages": []}, "messages"),
    ({"max_tokens": 4, "messages": ASK, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}},
     "not among the tools"),
    ({"max_tokens": 4, "messages": ASK, "tool_choice": {"type": "any"}}, "needs tools"),
    ({"max_tokens": 4, "messages": ASK, "temperature": 1.5}, "temperature"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
])
def test_bad_requests_get_anthropics_error_shape(server, body, says):
    response = httpx.post(f"{server.url}/v1/messages", json={"model": "kvserve"} | body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert says in error["error"]["message"]


def test_the_sdk_raises_its_own_error_for_a_bad_request(client):
    with pytest.raises(anthropic.BadRequestError, match="not among the tools"):
        client.messages.create(model="kvserve", max_tokens=4, messages=ASK, tools=TOOLS,
                               tool_choice={"type": "tool", "name": "nope"})


def test_fields_claude_code_sends_are_ignored_not_refused(server):
    body = {"model": "kvserve", "max_tokens": 3, "temperature": 0, "metadata": {"user_id": "u"},
            "system": [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]},
                         {"role": "assistant", "content": [{"type": "thinking", "thinking": "...", "signature": "s"},
                                                           {"type": "text", "text": "hello"}]},
                         {"role": "user", "content": "again"}],
            "thinking": {"type": "enabled", "budget_tokens": 1024}, "context_management": {"edits": []},
            "tools": [TOOLS[0] | {"cache_control": {"type": "ephemeral"}}]}
    response = httpx.post(f"{server.url}/v1/messages", json=body, timeout=60,
                          headers={"anthropic-version": "2023-06-01", "anthropic-beta": "interleaved-thinking-2025-05-14"})
    assert response.status_code == 200, response.text
    assert response.json()["content"][0]["type"] == "text"


def test_the_api_key_is_accepted_as_x_api_key(model_dir):
    with serve(model_dir("long"), api_key="sekret") as running:
        good = anthropic.Anthropic(base_url=running.url, api_key="sekret", max_retries=0)  # sends x-api-key
        assert good.messages.create(model="kvserve", max_tokens=2, messages=ASK).type == "message"
        bad = anthropic.Anthropic(base_url=running.url, api_key="wrong", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError):
            bad.messages.create(model="kvserve", max_tokens=2, messages=ASK)
        refused = httpx.post(f"{running.url}/v1/messages", json={"model": "kvserve", "max_tokens": 2, "messages": ASK})
        assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"


@pytest.mark.parametrize("path, body", [
    ("/v1/messages", {"model": "kvserve", "max_tokens": 480, "messages": ASK}),
    ("/v1/responses", {"model": "kvserve", "max_output_tokens": 480, "input": "hi"}),
])
@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_frees_its_slot(server, path, body, stream):
    import socket
    from urllib.parse import urlparse

    from tests.test_server import metric_values

    key = 'kvserve_request_failures_total{"reason": "client_disconnect"}'
    before = metric_values(httpx.get(f"{server.url}/metrics").text).get(key, 0)
    if stream:
        with httpx.stream("POST", f"{server.url}{path}", json=body | {"stream": True}, timeout=60) as response:
            lines = response.iter_lines()  # held: a closed iterator would close the stream, and end the request
            next(line for line in lines if line.startswith("data:"))
            assert server.runner.wait_for(lambda s: s.running == 1, timeout=30)
    else:
        address, raw = urlparse(server.url), json.dumps(body).encode()
        with socket.create_connection((address.hostname, address.port)) as sock:
            sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
                         + f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
            assert server.runner.wait_for(lambda s: s.running == 1, timeout=30)
    # gone without reading the answer: the request is aborted, not run to its 480 tokens
    assert server.runner.wait_for(lambda s: s.running == 0 and s.waiting == 0, timeout=30)
    assert metric_values(httpx.get(f"{server.url}/metrics").text).get(key, 0) - before == 1


def test_claude_codes_request_shape_is_served(server):
    """What Claude Code 2.1 sends: system-role messages between the turns, max_tokens far past the context (a
    bound: the reply ends at the slot's end), output_config's effort and a JSON schema (its title requests)."""
    schema = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 12}}, "required": ["title"],
              "additionalProperties": False}
    body = {"model": "kvserve", "max_tokens": 32000, "stream": False, "thinking": {"type": "adaptive"},
            "messages": [ASK[0], {"role": "system", "content": "Agents available: none."}],
            "output_config": {"effort": "high", "format": {"type": "json_schema", "schema": schema}}}
    reply = httpx.post(f"{server.url}/v1/messages?beta=true", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    jsonschema.validate(json.loads(reply.json()["content"][0]["text"]), schema)
    both = body | {"output_format": {"type": "json_schema", "schema": schema}}
    refused = httpx.post(f"{server.url}/v1/messages", json=both, timeout=60)
    assert refused.status_code == 400 and "not both" in refused.json()["error"]["message"]
