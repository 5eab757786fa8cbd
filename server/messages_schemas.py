"""Request bodies of Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens), read into a Conversation.

Types are strict, as everywhere in kvserve. Unknown fields are ignored, not refused: Claude Code and the
`anthropic` SDK send beta fields (cache_control on blocks, context_management, betas, ...) that change nothing
a local server does."""

from __future__ import annotations

import json
from typing import Annotated, Literal, Union

from pydantic import Field, StrictBool, model_validator

from engine import SamplingParams
from engine.grammar import json_schema_grammar
from engine.sampling import BOUNDS, InvalidParameter
from server.conversation import Conversation, Prompt, Turn
from server.schemas import Lenient


class TextBlock(Lenient):
    type: Literal["text"]
    text: str


class ToolUseBlock(Lenient):
    """An assistant turn's call."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict


class ToolResultBlock(Lenient):
    """A user turn's answer to a call: text, or text blocks."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: StrictBool = False

    @property
    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)
        return f"Error: {text}" if self.is_error else text


class ThinkingBlock(Lenient):
    """An earlier turn's reasoning, as a client sends it back: not shown to the model again (as Anthropic's own
    models drop earlier turns' thinking)."""

    type: Literal["thinking", "redacted_thinking"]


Block = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock], Field(discriminator="type")]


class MessageParam(Lenient):
    # "system" too: Claude Code sends system-role messages between the turns (agent listings, reminders).
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class ToolParam(Lenient):
    """A client tool. Anthropic's server tools (web search, ...) have a `type` of their own: kvserve runs none."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    input_schema: dict
    type: Literal["custom"] | None = None

    def openai(self) -> dict:
        """The same tool as OpenAI's function tool object, the form a Conversation holds."""
        function = {"name": self.name, "parameters": self.input_schema}
        return {"type": "function", "function": function | ({"description": self.description} if self.description else {})}


class ToolChoiceParam(Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: StrictBool = False

    @model_validator(mode="after")
    def _named_when_tool(self):
        if (self.type == "tool") != (self.name is not None):
            raise ValueError('tool_choice needs a name exactly when its type is "tool"')
        return self

    @property
    def choice(self) -> str:
        """As a Conversation says it: auto, none, required, or the function's name."""
        return {"auto": "auto", "none": "none", "any": "required"}.get(self.type, self.name)


class ThinkingParam(Lenient):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=1)


class OutputFormat(Lenient):
    """Anthropic's structured output: the reply is JSON that follows `schema` (a grammar enforces it)."""

    type: Literal["json_schema"]
    schema_: dict | bool = Field(alias="schema")


class OutputConfig(Lenient):
    format: OutputFormat | None = None
    effort: str | None = None  # how hard a Claude model thinks: nothing to set here


class MetadataParam(Lenient):
    user_id: str | None = None


class CountTokensRequest(Lenient):
    """What a Messages request says about its prompt: enough to count it."""

    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingParam | None = None
    chat_template_kwargs: dict | None = None  # more of the template's variables, as on the other chat routes

    @property
    def system_text(self) -> str:
        if isinstance(self.system, list):
            return "\n\n".join(b.text for b in self.system)
        return self.system or ""

    def conversation(self, tool_format: str) -> Conversation:
        """The turns as a Conversation: tool_use blocks become the assistant's calls, tool_result blocks tool turns
        (before the user's own text of that turn, which follows the results)."""
        turns = [Turn("system", self.system_text)] if self.system_text else []
        for m in self.messages:
            blocks = [TextBlock(type="text", text=m.content)] if isinstance(m.content, str) else m.content
            text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
            if m.role == "assistant":
                calls = tuple({"id": b.id, "type": "function", "function": {
                    "name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
                    for b in blocks if isinstance(b, ToolUseBlock))
                turns.append(Turn("assistant", text, calls))
                continue
            if any(isinstance(b, ToolUseBlock) for b in blocks):
                raise InvalidParameter("tool_use blocks belong to assistant messages")
            if m.role == "system":
                turns.append(Turn("system", text))
                continue
            turns += [Turn("tool", b.text, call_id=b.tool_use_id) for b in blocks if isinstance(b, ToolResultBlock)]
            if text or not any(isinstance(b, ToolResultBlock) for b in blocks):
                turns.append(Turn("user", text))
        choice = self.tool_choice or ToolChoiceParam(type="auto")
        # thinking on or off reaches a template that reads enable_thinking (Qwen3's); others ignore it.
        variables = {} if self.thinking is None else {"enable_thinking": self.thinking.type != "disabled"}
        variables |= self.chat_template_kwargs or {}
        budget = self.thinking.budget_tokens if self.thinking and self.thinking.type == "enabled" else None
        return Conversation(tuple(turns), tuple(t.openai() for t in self.tools or ()), choice.choice,
                            not choice.disable_parallel_tool_use, tool_format, template_variables=variables,
                            reasoning_budget=budget)


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(**BOUNDS["max_new_tokens"].field())
    stop_sequences: list[Annotated[str, Field(min_length=1)]] | None = None
    stream: StrictBool = False
    temperature: float | None = Field(default=None, ge=0, le=1)  # Anthropic's range
    top_p: float | None = Field(default=None, **BOUNDS["top_p"].field())
    top_k: int | None = Field(default=None, ge=0)
    metadata: MetadataParam | None = None
    output_config: OutputConfig | None = None
    output_format: OutputFormat | None = None  # the beta's name for output_config.format

    @property
    def stops(self) -> tuple[str, ...]:
        return tuple(self.stop_sequences or ())

    def constraint(self) -> str | None:
        """The structured-output grammar the request asks for, or None."""
        form = self.output_format or (self.output_config.format if self.output_config else None)
        if self.output_format and self.output_config and self.output_config.format:
            raise InvalidParameter("set output_config.format or output_format, not both")
        return json_schema_grammar(form.schema_) if form else None

    def sampling(self, prompt: Prompt, room: int) -> SamplingParams:
        """`room`: the tokens left in a slot after the prompt. max_tokens is a bound, not a demand (Claude Code
        asks for 32000 whatever the model): past the room the reply ends with stop_reason max_tokens, as
        llama.cpp's server clamps it."""
        return SamplingParams(
            max_new_tokens=max(1, min(self.max_tokens, room)),
            temperature=self.temperature if self.temperature is not None else 1.0,  # Anthropic's default
            top_p=self.top_p if self.top_p is not None else 1.0,
            top_k=self.top_k or 0,
            stop=self.stops,
            grammar=prompt.grammar(self.constraint()),
        )
