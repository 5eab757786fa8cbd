"""Tool calling on /v1/chat/completions: tools offered to the model, calls enforced and parsed (real server)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from engine.chat_template import ChatTemplate
from server import tool_calls
from server.schemas import ChatCompletionRequest
from tests.server_harness import serve

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}},
                                       "required": ["zone"], "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(model_dir):
    with serve(model_dir("long"), max_seq_len=2048) as running:  # the tools preamble is long in tiny tokens
        yield running


def checked(calls) -> list[tuple[str, dict]]:
    """(name, arguments) of each call, each validated against its function's parameter schema."""
    found = []
    for call in calls:
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        found.append((call.function.name, arguments))
    return found


def test_required_and_named_calls_are_valid_calls_streamed_or_not(server):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    for seed in range(4):
        for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
            ask = dict(model="kvserve", messages=ASK, tools=[WEATHER, CLOCK], tool_choice=choice, max_tokens=300,
                       temperature=1.0, seed=seed, parallel_tool_calls=False, logprobs=True)  # one call, then it ends
            reply = client.chat.completions.create(**ask).choices[0]
            assert reply.finish_reason == "tool_calls" and reply.message.content is None
            calls = checked(reply.message.tool_calls)
            assert len(calls) == 1 and (choice == "required" or calls[0][0] == "get_time")
            streamed = [c.choices[0] for c in client.chat.completions.create(**ask, stream=True) if c.choices]
            deltas = [d for c in streamed for d in c.delta.tool_calls or ()]
            assert [(d.function.name, json.loads(d.function.arguments)) for d in deltas] == calls  # as the reply
            assert [d.index for d in deltas] == list(range(len(deltas))) and streamed[-1].finish_reason == "tool_calls"
            # Every token's logprob once, streamed as in the reply, though the text was held back to the end.
            assert [t.token for c in streamed for t in c.logprobs.content] == [t.token for t in reply.logprobs.content]


def test_a_reply_without_calls_stays_content(server):
    body = {"messages": ASK, "tools": [WEATHER], "tool_choice": "none", "max_tokens": 5, "temperature": 0}
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
    assert "tool_calls" not in reply["message"] and isinstance(reply["message"]["content"], str)


def test_parse_reads_hermes_blocks_and_leaves_the_rest():
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    content, calls = tool_calls.parse(text)
    assert content == "Let me look." and [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"} and calls[0]["id"].startswith("call_")
    assert tool_calls.parse("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    assert tool_calls.parse("plain") == ("plain", [])


def test_a_conversation_with_calls_and_results_renders_both_ways():
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                      "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    body = ChatCompletionRequest.model_validate({"messages": history, "tools": [WEATHER]})
    # A template without `tools`: the tools in a system message, the earlier call as the text the model writes.
    messages, tools = body.conversation("hermes").rendered(template_takes_tools=False)
    assert tools is None and messages[0]["role"] == "system" and "get_weather" in messages[0]["content"]
    assert '"city": "Paris"' in messages[2]["content"] and messages[3] == {
        "role": "tool", "content": "18 degrees, sunny", "tool_call_id": "call_1"}
    # A template that renders `tools` gets them, and the call's arguments as an object, as transformers passes them.
    template = ChatTemplate("{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}"
                            "{% for c in m.tool_calls or [] %}<{{ c.function.name }} {{ c.function.arguments.city }}>"
                            "{% endfor %}{{ m.content or '' }}|{% endfor %}")
    assert template.takes_tools
    messages, tools = body.conversation("hermes").rendered(template_takes_tools=True)
    assert template.render(messages, tools=tools) == (
        "[get_weather]What is the weather in Paris?|<get_weather Paris>|18 degrees, sunny|")


@pytest.mark.parametrize("body,says", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [WEATHER]}, "not among the tools"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "name"),
    ({"tools": [WEATHER, WEATHER]}, "same name"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
])
def test_bad_tools_are_refused_with_what_is_wrong(server, body, says):
    response = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": ASK} | body, timeout=60)
    assert response.status_code == 400 and says in response.json()["error"]["message"], response.text


LLAMA3_TEMPLATE = (  # enough of Llama 3.1's: tools in the first user turn, calls as bare JSON with "parameters"
    "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
    "{% if loop.first and tools %}Answer with a JSON call {\"name\": name, \"parameters\": {...}} to one of: "
    "{% for t in tools %}{{ t | tojson }}{% endfor %}\n{% endif %}"
    "{% for c in m.tool_calls or [] %}<|python_tag|>{{ c.function | tojson }}{% endfor %}"
    "{{ m.content or '' }}<|eot_id|>{% endfor %}<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_the_tool_call_format_is_read_from_the_template():
    assert tool_calls.chosen("auto", LLAMA3_TEMPLATE, template_takes_tools=True) == "llama3"
    assert tool_calls.chosen("auto", "{{ tools }} <tool_call>", template_takes_tools=True) == "hermes"
    assert tool_calls.chosen("llama3", LLAMA3_TEMPLATE, template_takes_tools=False) == "hermes"  # kvserve's offer
    assert tool_calls.chosen("hermes", LLAMA3_TEMPLATE, template_takes_tools=True) == "hermes"


def test_llama3_calls_parse_with_or_without_the_python_tag():
    two = '<|python_tag|>{"name": "get_time", "parameters": {"zone": "CET"}}; {"name": "get_weather", "parameters": {}}'
    content, calls = tool_calls.parse(two, "llama3")
    assert content is None and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_time", {"zone": "CET"}), ("get_weather", {})]
    assert tool_calls.parse("It is sunny.", "llama3") == ("It is sunny.", [])
    assert tool_calls.parse('{"no": "name"}', "llama3") == ('{"no": "name"}', [])


def test_a_llama3_template_gets_llama3_calls(model_dir, tmp_path):
    import shutil

    folder = shutil.copytree(model_dir("long"), tmp_path / "llama3_tools")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": LLAMA3_TEMPLATE}))
    body = {"messages": ASK, "tools": [WEATHER, CLOCK], "tool_choice": "required", "parallel_tool_calls": False,
            "max_tokens": 300, "temperature": 1.0, "seed": 2, "logprobs": True}
    with serve(folder, max_seq_len=2048) as server:
        reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
    assert reply["finish_reason"] == "tool_calls" and reply["message"]["content"] is None
    written = "".join(token["token"] for token in reply["logprobs"]["content"])  # what the model wrote, tokens joined
    assert written.startswith('{"name":') and '"parameters":' in written
    (call,) = reply["message"]["tool_calls"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])


def test_parameters_with_defs_give_a_valid_call(server):
    """pydantic writes a nested model as "$defs" and "$ref": "#/$defs/..." (as the OpenAI Agents SDK sends it);
    inside the tool-call grammar those references still name the parameters' own definitions."""
    from openai import OpenAI
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=12)
        country: str = Field(max_length=12)

    class Trip(BaseModel):
        origin: City
        stops: list[City] = Field(max_length=2)

    schema = Trip.model_json_schema()
    assert "$defs" in schema
    for spelling in ("$defs", "definitions"):  # draft-07's spelling too
        parameters = json.loads(json.dumps(schema).replace("$defs", spelling))
        tool = {"type": "function", "function": {"name": "plan", "parameters": parameters}}
        client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
        for choice in ("required", {"type": "function", "function": {"name": "plan"}}):
            reply = client.chat.completions.create(model="kvserve", messages=ASK, tools=[tool, CLOCK], tool_choice=choice,
                                                   max_tokens=400, temperature=1.0, seed=1, parallel_tool_calls=False)
            (call,) = reply.choices[0].message.tool_calls
            if call.function.name == "plan":
                Trip.model_validate_json(call.function.arguments)
            else:
                jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_time"])
