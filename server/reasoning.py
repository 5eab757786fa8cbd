"""Reasoning kept apart from the answer: the text a thinking model writes between `<think>` and `</think>`.

Formats (--reasoning-parser):
- qwen3: reasoning where the reply opens `<think>` itself (Qwen3 and QwQ), or where the prompt left one open;
- deepseek_r1: the reply starts inside the reasoning whether or not it writes `<think>` (DeepSeek-R1 and its
  distills, whose templates open it in the prompt): everything up to `</think>` is reasoning;
- none: no reasoning, all text is the answer; auto: qwen3 for a chat template that mentions `<think>`, else none.

The split runs on the text as it streams (Reasoning.push; server/conversation.py's Prompt makes one per reply),
holding back what may be the start of a tag, so a stream's reasoning and answer concatenate to the whole reply's.
A grammar (structured output, a forced tool call) constrains the answer only: `after_reasoning` wraps it so the
reasoning before `</think>` is free text, bounded where a request gives a budget (Anthropic's
thinking.budget_tokens: about 4 characters a token, as the grammar counts characters).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

PARSERS = ("auto", "none", "deepseek_r1", "qwen3")
CHARACTERS_PER_TOKEN = 4  # a reasoning budget in tokens, as the grammar's bound in characters
OPEN, CLOSE = "<think>", "</think>"


def chosen(parser: str, template_source: str | None) -> str:
    """The format of a served model's reasoning: `parser` unless auto; auto reads the chat template."""
    if parser != "auto":
        return parser
    return "qwen3" if template_source and OPEN in template_source else "none"


def opened_by(prompt: str) -> bool:
    """Whether the rendered prompt leaves a `<think>` open (the template started the reply's reasoning)."""
    return prompt.rfind(OPEN) > prompt.rfind(CLOSE)


def held_back(text: str, tag: str) -> int:
    """How many characters at the end of `text` may be the start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@dataclass
class Reasoning:
    """A reply's text split as it comes: push(piece) -> (new reasoning, new answer); finish() gives what was held
    back. `inside`: the reply starts inside the reasoning (the prompt opened it, or the format says it does); a
    `<think>` the reply writes first is dropped either way."""

    inside: bool
    state: str = "start"  # "start" (a <think> may still open), "reasoning", "answer"
    held: str = ""  # text that may be the start of a tag, not said yet
    reasoning: str = ""
    answer: str = ""
    entered: bool = False  # whether the reply had reasoning (opened, or began inside it)
    trim: bool = False  # the whitespace right after </think> is not the answer's

    def push(self, piece: str) -> tuple[str, str]:
        text, said_reasoning, said_answer = self.held + piece, "", ""
        self.held = ""
        while text:
            if self.state == "start":
                stripped = text.lstrip()
                if stripped.startswith(OPEN):
                    self.state, self.entered, text = "reasoning", True, stripped[len(OPEN):]
                elif OPEN.startswith(stripped):  # whitespace, or the tag's beginning: wait for more
                    self.held, text = text, ""
                else:
                    self.state, self.entered = ("reasoning", True) if self.inside else ("answer", False)
            elif self.state == "reasoning":
                at = text.find(CLOSE)
                if at >= 0:
                    said_reasoning += text[:at]
                    self.state, self.trim, text = "answer", True, text[at + len(CLOSE):]
                else:
                    keep = held_back(text, CLOSE)
                    said_reasoning += text[:len(text) - keep]
                    self.held, text = text[len(text) - keep:], ""
            else:
                if self.trim:
                    text = text.lstrip()
                    self.trim = not text
                said_answer, text = said_answer + text, ""
        self.reasoning += said_reasoning
        self.answer += said_answer
        return said_reasoning, said_answer

    def take(self, piece: str, last: bool) -> tuple[str, str]:
        """push(piece), and with the reply's last piece what finish() releases too: what a renderer sends now."""
        thought, said = self.push(piece)
        if last:
            more = self.finish()
            thought, said = thought + more[0], said + more[1]
        return thought, said

    def finish(self) -> tuple[str, str]:
        """What was held back at the end: an unclosed tag's start is reasoning; before any, the answer's."""
        held, self.held = self.held, ""
        if self.state == "reasoning" or (self.state == "start" and self.inside):
            self.entered = True
            self.reasoning += held
            return held, ""
        self.answer += held
        return "", held


def after_reasoning(grammar: str | None, inside: bool, budget: int | None = None) -> str:
    """`grammar` (llguidance's grammar text: Lark, or its JSON form; None: any answer) behind free reasoning
    text: an optional `<think>` (unless the prompt opened it), anything up to `</think>` (at most `budget`
    characters, after which `</think>` is the only way on), then the answer the grammar allows."""
    if grammar is None:
        answer = {"lark_grammar": "start: /(?s:.*)/"}
    else:
        answer = json.loads(grammar)["grammars"][0] if grammar.lstrip().startswith("{") else {"lark_grammar": grammar}
    opening = "" if inside else f'"{OPEN}" '
    text = "(?s:.*)" if budget is None else f"(?s:.{{0,{budget}}})"
    lark = "\n".join([f"start: {opening}reasoning answer", "answer: @answer",
                      f"reasoning[lazy]: /{text}<\\/think>/", "%ignore /[ \\t\\r\\n]+/"])
    return json.dumps({"grammars": [{"lark_grammar": lark}, {**answer, "name": "answer"}]})
