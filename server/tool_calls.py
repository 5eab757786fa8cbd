"""Tool calls in the Hermes format Llama-family chat models are trained on (Qwen2, Hermes, SmolLM2):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The tools reach the model through its chat template's `tools` variable, or, for a template without one, as a
system message that lists them and shows this format. `tool_choice` "required" or a named function is enforced
by a grammar, so the reply is a call whose arguments follow the function's parameter schema; with "auto" the
model decides, and the reply is parsed after the fact.
"""

from __future__ import annotations

import json
import re
import uuid

OPEN, CLOSE = "<tool_call>", "</tool_call>"
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


def grammar(tools: list[dict], name: str | None, parallel: bool) -> str:
    """A Lark grammar (llguidance's) for a reply of calls only: to the function `name`, or to any of `tools`;
    one call, or with `parallel` one or more."""
    offered = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    schema = {"anyOf": [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": closed(f)},
                         "required": ["name", "arguments"], "additionalProperties": False} for f in offered],
              "x-guidance": {"whitespace_flexible": False}}  # compact JSON, as for response formats
    repeat = "+" if parallel else ""
    return "\n".join([f"start: (call){repeat}", f'call: "{OPEN}\\n" body "\\n{CLOSE}"',
                      f"body: %json {json.dumps(schema)}"])


def closed(function: dict) -> dict:
    """A function's parameter schema, with no arguments beyond those it names unless it says otherwise (as
    OpenAI's strict calls): a small model left free to add keys may never close the object."""
    parameters = function.get("parameters") or {"type": "object"}
    if "additionalProperties" in parameters or function.get("strict") is False:
        return parameters
    return parameters | {"additionalProperties": False}


def parse(text: str) -> tuple[str | None, list[dict]]:
    """(the text outside the calls or None, OpenAI tool_calls) of a reply; a block that is not a JSON call with
    a name stays in the text."""
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
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {
            "name": call["name"], "arguments": json.dumps(call.get("arguments", call.get("parameters", {})),
                                                          ensure_ascii=False)}})
    rest = ("".join(kept) + text[start:]).strip()
    return (rest or None) if calls else text, calls
