"""Tool calls in the two formats Llama-family chat models are trained on:

- Hermes (Qwen2, Hermes, and kvserve's own offer to a template without tools):
      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>
- Llama 3 (3.1, 3.2): the reply is the call, as JSON, maybe after <|python_tag|>:
      {"name": "get_weather", "parameters": {"city": "Paris"}}

The tools reach the model through its chat template's `tools` variable, or, for a template without one, as a
system message that lists them and shows the Hermes format. `tool_choice` "required" or a named function is
enforced by a grammar, so the reply is a call whose arguments follow the function's parameter schema; with
"auto" the model decides, and the reply is parsed after the fact.
"""

from __future__ import annotations

import copy
import json
import re
import uuid

from engine.json_schema import checked, rooted_at, subschemas

PARSERS = ("auto", "hermes", "llama3")
OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)


def preamble(tools: list[dict]) -> str:
    """The system text that offers `tools` (OpenAI's tool objects) to a model whose template has no `tools`."""
    listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return ("You can call functions to answer the user. The functions, as JSON schemas, are listed between "
            f"<tools> and </tools>:\n<tools>\n{listed}\n</tools>\nTo call one, reply with its name and arguments as "
            f'a JSON object between {OPEN} and {CLOSE}, one block per call:\n{OPEN}\n'
            f'{{"name": "<function name>", "arguments": {{<arguments>}}}}\n{CLOSE}')


def as_text(calls: list[dict]) -> str:
    """An assistant turn's earlier calls (OpenAI's tool_calls) as the model writes them, for a template without
    tool support."""
    return "\n".join(f'{OPEN}\n{json.dumps({"name": c["function"]["name"], "arguments": arguments(c)})}\n{CLOSE}'
                     for c in calls)


def arguments(call: dict) -> dict | str:
    """A call's arguments as an object when they are a JSON object (templates expect one), else as sent."""
    try:
        value = json.loads(call["function"]["arguments"])
    except (json.JSONDecodeError, TypeError):
        return call["function"]["arguments"]
    return value if isinstance(value, dict) else call["function"]["arguments"]


def chosen(parser: str, template_source: str | None, template_takes_tools: bool) -> str:
    """The format of a model's calls. A template without tools gets kvserve's offer, which shows Hermes; for one
    with tools, `parser` unless "auto", and auto reads the template (Llama 3's asks for "parameters" and has
    <|python_tag|>)."""
    if not template_takes_tools:
        return "hermes"
    if parser != "auto":
        return parser
    if template_source and (PYTHON_TAG in template_source or ('"parameters"' in template_source and OPEN not in template_source)):
        return "llama3"
    return "hermes"


def grammar(tools: list[dict], name: str | None, parallel: bool, form: str = "hermes") -> str:
    """A Lark grammar (llguidance's) for a reply of calls only, in `form`: to the function `name`, or to any of
    `tools`; one call, or with `parallel` one or more."""
    key = "parameters" if form == "llama3" else "arguments"
    offered = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    # Each function's parameters lie under $defs, their own references rooted there: pydantic's nested models
    # refer to "#/$defs/...", which inside this wrapper would name the wrapper's.
    schema = {"$defs": {f"tool{i}": rooted_at(checked(closed(f)), f"#/$defs/tool{i}") for i, f in enumerate(offered)},
              "anyOf": [{"type": "object", "properties": {"name": {"const": f["name"]}, key: {"$ref": f"#/$defs/tool{i}"}},
                         "required": ["name", key], "additionalProperties": False} for i, f in enumerate(offered)],
              "x-guidance": {"whitespace_flexible": False}}  # compact JSON, as for response formats
    if form == "llama3":
        return "\n".join(["start: call (\";\" call)*" if parallel else "start: call", f"call: %json {json.dumps(schema)}"])
    repeat = "+" if parallel else ""
    return "\n".join([f"start: (call){repeat}", f'call: "{OPEN}\\n" body "\\n{CLOSE}"',
                      f"body: %json {json.dumps(schema)}"])


def closed(function: dict) -> dict:
    """A function's parameter schema, with no arguments beyond those it names unless it says otherwise (as
    OpenAI's strict calls), in nested objects with named properties too (pydantic's nested models): a small
    model left free to add keys may never close the object."""
    parameters = function.get("parameters") or {"type": "object"}
    if function.get("strict") is False:
        return parameters
    parameters = copy.deepcopy(parameters)
    for node in subschemas(parameters):
        if (node is parameters or "properties" in node) and "additionalProperties" not in node:
            node["additionalProperties"] = False
    return parameters


def parse(text: str, form: str = "hermes") -> tuple[str | None, list[dict]]:
    """(the text outside the calls or None, OpenAI tool_calls) of a reply in `form`; a block that is not a JSON
    call with a name stays in the text."""
    if form == "llama3":
        return parse_llama3(text)
    calls, kept, start = [], [], 0
    for match in CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            continue
        kept.append(text[start:match.start()])
        start = match.end()
        calls.append(openai_call(call))
    rest = ("".join(kept) + text[start:]).strip()
    return (rest or None) if calls else text, calls


def parse_llama3(text: str) -> tuple[str | None, list[dict]]:
    """Llama 3's calls: the whole reply (after an optional <|python_tag|>) is one JSON call, or several joined by
    ";"; anything else is content."""
    body, at, calls = text.strip().removeprefix(PYTHON_TAG).strip(), 0, []
    decoder = json.JSONDecoder()
    while at < len(body):
        try:
            call, at = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            return text, []
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return text, []
        calls.append(openai_call(call))
        at = len(body) - len(body[at:].lstrip().removeprefix(";").lstrip())  # past the separator
    return (None, calls) if calls else (text, [])


def openai_call(call: dict) -> dict:
    """OpenAI's tool_calls entry for a parsed {"name", "arguments" or "parameters"}."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {
        "name": call["name"], "arguments": json.dumps(call.get("arguments", call.get("parameters", {})),
                                                      ensure_ascii=False)}}
