"""Structured output: a grammar, not the model, guarantees the output's shape (tiny random models, real server)."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from engine import EngineConfig, InvalidParameter, SamplingParams
from engine.grammar import choice_grammar, json_schema_grammar, regex_grammar
from tests.server_harness import serve
from weights.loading import load_engine

NESTED = {  # objects, arrays with bounds, enums, integers with ranges, required fields
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 1,
                   "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "scores", "address", "active"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(model_dir):
    return load_engine(model_dir("long"), EngineConfig(device="cpu", dtype="float32", max_batch_size=4,
                                                                  max_seq_len=512, seed=0))


def test_twenty_sampled_outputs_all_follow_a_nested_schema(engine):
    grammar = json_schema_grammar(NESTED)
    sampled = [SamplingParams(max_new_tokens=400, temperature=1.0, seed=seed, grammar=grammar) for seed in range(20)]
    for completion in engine.generate(["Describe a user:"] * 20, sampled):
        assert completion.finish_reason == "eos", completion.text  # the object closed, and nothing followed
        jsonschema.validate(json.loads(completion.text), NESTED)
        assert not re.search(r"\s", re.sub(r'"(\\.|[^"\\])*"', '""', completion.text))  # compact: no space between tokens


def test_regex_and_choice_outputs_match(engine):
    pattern = r"[A-Z][a-z]{2,5}-[0-9]{3}"
    sampled = [SamplingParams(max_new_tokens=40, temperature=1.0, seed=seed, grammar=regex_grammar(pattern))
               for seed in range(4)]
    sampled += [SamplingParams(max_new_tokens=40, temperature=1.0, seed=seed, grammar=choice_grammar(["yes", "no", "maybe so"]))
                for seed in range(4)]
    completions = engine.generate(["Answer:"] * 8, sampled)
    assert all(re.fullmatch(pattern, c.text) for c in completions[:4])
    assert all(c.text in ("yes", "no", "maybe so") for c in completions[4:])


def test_free_requests_beside_constrained_ones_get_their_own_tokens(engine):
    free = [SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True),
            SamplingParams(max_new_tokens=12, temperature=1.0, seed=5, ignore_eos=True)]
    alone = [c.output_ids for c in engine.generate(["The quick brown fox", "Once upon a time"], free)]
    constrained = SamplingParams(max_new_tokens=60, temperature=1.0, seed=1, grammar=json_schema_grammar(NESTED))
    mixed = engine.generate(["The quick brown fox", "x", "Once upon a time", "y"], [free[0], constrained, free[1], constrained])
    assert [mixed[0].output_ids, mixed[2].output_ids] == alone


@pytest.fixture(scope="module")
def server(model_dir):
    with serve(model_dir("long")) as running:
        yield running


def test_openai_parse_returns_a_model_instance(server):
    from typing import Literal

    from openai import OpenAI
    from pydantic import BaseModel, Field

    class Weather(BaseModel):
        city: Literal["Paris", "Rome", "Oslo"]
        celsius: int = Field(ge=-40, le=50)
        sunny: bool

    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    for seed in range(3):
        reply = client.chat.completions.parse(model="kvserve", messages=[{"role": "user", "content": "Weather?"}],
                                              response_format=Weather, max_tokens=60, temperature=1.0, seed=seed)
        assert isinstance(reply.choices[0].message.parsed, Weather) and reply.choices[0].finish_reason == "stop"


def test_every_structured_field_of_every_route(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        def text(path: str, body: dict) -> str:
            response = client.post(path, json=body)
            assert response.status_code == 200, response.text
            result = response.json()
            return result["generated_text"] if "generated_text" in result else result["choices"][0]["text"]

        tgi = {"type": "json", "value": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                          "maximum": 9}}, "required": ["n"], "additionalProperties": False}}
        assert json.loads(text("/generate", {"inputs": "x", "parameters": {"max_new_tokens": 30, "grammar": tgi}})) in (
            [{"n": n} for n in range(10)])
        assert re.fullmatch("[ab]{3}", text("/generate", {"inputs": "x", "parameters": {
            "max_new_tokens": 30, "grammar": {"type": "regex", "value": "[ab]{3}"}}}))
        completion = {"prompt": "x", "max_tokens": 30, "temperature": 1.0, "seed": 3}
        assert text("/v1/completions", completion | {"guided_choice": ["left", "right"]}) in ("left", "right")
        assert re.fullmatch("[0-9]{2}", text("/v1/completions", completion | {"guided_regex": "[0-9]{2}"}))
        assert text("/v1/completions", completion | {"response_format": {"type": "json_object"}}).startswith("{")
        assert text("/v1/completions", completion | {"structured_outputs": {"choice": ["up", "down"]}}) in ("up", "down")
        assert json.loads(text("/v1/completions", completion | {"guided_json": json.dumps({"enum": [1, 2]})})) in (1, 2)


@pytest.mark.parametrize("path,body,status,says", [
    ("/generate", {"inputs": "x", "parameters": {"grammar": {"type": "regex", "value": "("}}}, 422, "unclosed group"),
    ("/generate", {"inputs": "x", "parameters": {"grammar": {"type": "json", "value": "{not json"}}}, 422, "not valid JSON"),
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {
        "name": "bad", "schema": {"type": "objekt"}}}}, 400, "objekt"),
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "json_schema"}}, 400, "json_schema"),
    ("/v1/completions", {"prompt": "x", "guided_regex": "a", "guided_choice": ["b"]}, 400, "exactly one"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "guided_regex": "[0-9]",
                              "response_format": {"type": "json_object"}}, 400, "not several"),
])
def test_a_bad_constraint_is_refused_with_what_is_wrong(server, path, body, status, says):
    response = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert response.status_code == status and says in response.text, response.text
    assert httpx.get(f"{server.url}/health").status_code == 200


NO_FINITE_INSTANCE = {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}},
                      "$ref": "#/$defs/n"}


@pytest.mark.parametrize("path,body", [
    ("/generate", {"inputs": "x", "parameters": {"max_new_tokens": 20, "grammar": {"type": "json", "value": NO_FINITE_INSTANCE}}}),
    ("/generate_stream", {"inputs": "x", "parameters": {"max_new_tokens": 20, "grammar": {"type": "json", "value": NO_FINITE_INSTANCE}}}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 20, "guided_json": NO_FINITE_INSTANCE}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 20, "stream": True, "structured_outputs": {"json": NO_FINITE_INSTANCE}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 20, "response_format": {
        "type": "json_schema", "json_schema": {"name": "n", "schema": NO_FINITE_INSTANCE}}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 20, "stream": True,
                              "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": NO_FINITE_INSTANCE}}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 20, "tool_choice": "required",
                              "tools": [{"type": "function", "function": {"name": "f", "parameters": NO_FINITE_INSTANCE}}]}),
])
def test_a_schema_with_no_finite_instance_is_refused_before_any_token(server, path, body):
    """Refused when the request arrives, streamed or not, with a short message: not a 5xx or an error event once
    decoding reaches the recursion, and none of llguidance's parser state."""
    response = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    status = 400 if path.startswith("/v1") else 422
    assert response.status_code == status and "no finite JSON value" in response.text, response.text
    assert response.headers["content-type"].startswith("application/json") and len(response.text) < 600


def test_a_schema_that_refers_to_itself_alone_is_any_json_value(server):
    """{"$ref": "#"} constrains nothing: the output is JSON (the model may be cut off by max_new_tokens, so the
    test asks for enough tokens and a grammar-complete end)."""
    for seed in range(3):
        response = httpx.post(f"{server.url}/generate", timeout=60, json={"inputs": "x", "parameters": {
            "max_new_tokens": 200, "do_sample": True, "seed": seed, "details": True,
            "grammar": {"type": "json", "value": {"$ref": "#"}}}})
        assert response.status_code == 200, response.text
        result = response.json()
        if result["details"]["finish_reason"] == "eos_token":
            json.loads(result["generated_text"])
        assert result["generated_text"] != ""


def test_a_grammar_that_fails_while_decoding_ends_its_request_with_a_client_error(server, monkeypatch):
    """Past one of llguidance's limits mid-decode (a fault injected here: the matcher reports an error after
    its first token), the request ends with a 4xx that says so, and the server serves the next request."""
    grammars = server.runner.engine.grammars
    real_start = grammars.start

    class FailingAfterOneToken:
        def __init__(self, matcher):
            self.matcher, self.consumed = matcher, 0

        def __getattr__(self, name):
            return getattr(self.matcher, name)

        def consume_token(self, token):
            self.consumed += 1
            return self.matcher.consume_token(token)

        def is_error(self):
            return self.consumed >= 1

        def get_error(self):
            return "parser error: Too many items (limit 50000)\n<state>\nkilobytes of parser state"

    monkeypatch.setattr(grammars, "start", lambda grammar: FailingAfterOneToken(real_start(grammar)))
    body = {"prompt": "x", "max_tokens": 20, "response_format": {"type": "json_object"}}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400 and "Too many items" in response.text, response.text
    assert "<state>" not in response.text and "parser state" not in response.text
    monkeypatch.undo()
    assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": [1], "required": ["a"]}, {"allOf": 3}, {"anyOf": {"a": 1}}, {"type": 5},
    {"type": "array", "minItems": "2", "items": {"$ref": "#"}}, {"type": "object", "required": "abc"}, {"enum": 3},
    {"$ref": 5}, {"$ref": "#/nope"}, {"$ref": "http://elsewhere/schema"}, [1, 2], 3, None,
    {"type": "array", "prefixItems": 4, "minItems": 2}, json.loads("[" * 900 + "]" * 900),
    json.loads('{"items":' * 900 + "{}" + "}" * 900),
])
def test_a_malformed_schema_compiles_or_is_refused_never_raises_anything_else(schema):
    try:
        json_schema_grammar(schema)
    except InvalidParameter as refused:
        assert str(refused)
