"""Reasoning kept apart from the answer (<think>...</think>), on every chat-shaped route, streamed or not: a tiny
model whose chat template opens <think> for the reply, and a grammar (a reasoning budget, a forced call) that makes
it close it."""

from __future__ import annotations

import json
import shutil

import anthropic
import httpx
import jsonschema
import openai
import pytest

from server.reasoning import Reasoning
from tests.server_harness import serve
from tests.test_messages import GREEDY, TOOLS
from tests.test_tools import SCHEMAS
from tests.tiny import CHATML

# ChatML whose reply starts inside the reasoning, as DeepSeek-R1's and Qwen3's thinking templates do; with
# enable_thinking false it renders an empty, closed block instead (Qwen3's way).
THINKING = CHATML.replace("{{ '<|im_start|>assistant\n' }}", "{{ '<|im_start|>assistant\n' }}"
                          "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\n\n</think>\n\n' }}"
                          "{% else %}{{ '<think>\n' }}{% endif %}")
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def thinking_model(model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("thinking")
    shutil.copytree(model_dir("long"), folder, dirs_exist_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": THINKING}))
    return folder


@pytest.fixture(scope="module")
def server(thinking_model):
    with serve(thinking_model, max_seq_len=2048) as running:
        yield running


@pytest.mark.parametrize("text, inside, expected", [
    ("<think>a plan</think>\n\nThe answer", False, ("a plan", "The answer")),
    ("The answer alone", False, ("", "The answer alone")),
    ("a plan</think>The answer", True, ("a plan", "The answer")),
    ("<think>a plan</think>The answer", True, ("a plan", "The answer")),  # the tag the prompt opened, written again
    ("a plan cut short", True, ("a plan cut short", "")),
    ("  <think>x</think> y", False, ("x", "y")),
])
def test_the_split_streamed_piece_by_piece_is_the_whole_replys(text, inside, expected):
    whole = Reasoning(inside=inside)
    whole.push(text)
    whole.finish()
    assert (whole.reasoning, whole.answer) == expected
    for size in (1, 2, 3):
        split, said = Reasoning(inside=inside), []
        said += [split.push(text[i:i + size]) for i in range(0, len(text), size)] + [split.finish()]
        assert ("".join(r for r, _ in said), "".join(a for _, a in said)) == expected


def chat(server, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", json={"messages": ASK, "temperature": 0} | body, timeout=120)


def test_chat_gives_reasoning_content_apart_streamed_or_not(server):
    whole = chat(server, max_tokens=10).json()["choices"][0]
    message = whole["message"]
    assert message["reasoning_content"] and not message["content"]  # the reply never closed its reasoning
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=120,
                      json={"messages": ASK, "temperature": 0, "max_tokens": 10, "stream": True}) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content", "") for d in deltas) == (message["content"] or "")


def test_chat_template_kwargs_reach_the_template(server):
    message = chat(server, max_tokens=6, chat_template_kwargs={"enable_thinking": False}).json()["choices"][0]["message"]
    assert "reasoning_content" not in message and message["content"]  # the block was closed empty in the prompt
    refused = chat(server, max_tokens=2, chat_template_kwargs={"messages": []})
    assert refused.status_code == 400 and "messages" in refused.json()["error"]["message"]


def test_a_budget_closes_the_reasoning_and_the_grammar_holds_the_answer_only(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    ask = dict(model="kvserve", max_tokens=300, messages=ASK, tools=TOOLS,
               tool_choice={"type": "any", "disable_parallel_tool_use": True},
               thinking={"type": "enabled", "budget_tokens": 4}, **GREEDY)
    reply = client.messages.create(**ask)
    assert [b.type for b in reply.content] == ["thinking", "tool_use"] and reply.stop_reason == "tool_use"
    # 4 tokens' worth of characters (16), then </think> was forced; the grammar counts the characters of the
    # tokens' bytes, the text decodes a random model's stray bytes as characters of their own: about 16.
    assert 0 < len(reply.content[0].thinking) <= 2 * 16
    call = reply.content[1]
    jsonschema.validate(call.input, SCHEMAS[call.name])  # the grammar applied after the reasoning closed
    with client.messages.stream(**ask) as stream:
        final = stream.get_final_message()
    assert [(b.type, getattr(b, "thinking", None), getattr(b, "input", None)) for b in final.content] == [
        (b.type, getattr(b, "thinking", None), getattr(b, "input", None)) for b in reply.content]
    # Without tools the blocks stream as the text comes: thinking, then the text after </think>.
    plain = dict(model="kvserve", max_tokens=40, messages=ASK, thinking={"type": "enabled", "budget_tokens": 2}, **GREEDY)
    whole = client.messages.create(**plain)
    with client.messages.stream(**plain) as stream:
        streamed = stream.get_final_message()
    assert [b.type for b in whole.content] == ["thinking", "text"] and len(whole.content[0].thinking) <= 2 * 8
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in whole.content]


def test_responses_give_a_reasoning_item_streamed_or_not(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    ask = dict(model="kvserve", input="What is the weather in Paris?", max_output_tokens=8, temperature=0)
    whole = client.responses.create(**ask)
    assert [item.type for item in whole.output] == ["reasoning"] and whole.output_text == ""
    thought = whole.output[0].content[0].text
    events = list(client.responses.create(**ask, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output[0].content[0].text == thought


def test_without_a_parser_the_reasoning_stays_in_the_answer(thinking_model):
    with serve(thinking_model, reasoning_parser="none") as running:
        message = chat(running, max_tokens=6).json()["choices"][0]["message"]
    assert "reasoning_content" not in message and message["content"]


def test_responses_reasoning_effort_none_turns_the_thinking_off(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    response = client.responses.create(model="kvserve", input="What is the weather in Paris?", max_output_tokens=6,
                                       temperature=0, reasoning={"effort": "none"})
    assert [item.type for item in response.output] == ["message"] and response.output_text
    thinking = client.responses.create(model="kvserve", input="What is the weather in Paris?", max_output_tokens=6,
                                       temperature=0, reasoning={"effort": "high"})
    assert [item.type for item in thinking.output] == ["reasoning"]  # the template's <think> stays open
