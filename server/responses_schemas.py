"""Request bodies of OpenAI's Responses API (POST /v1/responses), read into a Conversation.

Types are strict. Unknown fields are ignored, not refused: Codex CLI and the Agents SDK send fields (`include`,
`prompt_cache_key`, `reasoning`, `service_tier`, ...) that change nothing a local server does. Tools other than
function tools (OpenAI's hosted web search, file search, ...) are OpenAI's to run: kvserve offers the model its
function tools only."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, StrictBool, Tag, model_validator

from engine import SamplingParams
from engine.grammar import json_object_grammar, json_schema_grammar
from engine.sampling import BOUNDS, InvalidParameter
from server.conversation import Conversation, Prompt, Turn
from server.schemas import Lenient


class TextPart(Lenient):
    """input_text (a user's), output_text (an earlier reply's) or refusal."""

    type: Literal["input_text", "output_text", "refusal", "text"]
    text: str | None = None
    refusal: str | None = None


class MessageItem(Lenient):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text or p.refusal or "" for p in self.content)


class FunctionCallItem(Lenient):
    """An earlier reply's call."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class FunctionCallOutputItem(Lenient):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]

    @property
    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text or "" for p in self.output)


class ReasoningItem(Lenient):
    """An earlier reply's reasoning, as a client sends it back: not shown to the model again."""

    type: Literal["reasoning"]


def item_kind(value: Any) -> str:
    """An input item's type; a bare {"role", "content"} is a message (OpenAI's EasyInputMessage)."""
    return value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "message")


InputItem = Annotated[Union[Annotated[MessageItem, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
                            Annotated[FunctionCallOutputItem, Tag("function_call_output")],
                            Annotated[ReasoningItem, Tag("reasoning")]], Discriminator(item_kind)]


class FunctionTool(Lenient):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict | None = None
    strict: StrictBool | None = None

    def openai(self) -> dict:
        """As Chat Completions' tool object, the form a Conversation holds."""
        return {"type": "function", "function": self.model_dump(exclude={"type"}, exclude_none=True)}


class OtherTool(Lenient):
    type: str


class NamedFunction(Lenient):
    type: Literal["function"]
    name: str


class TextFormat(Lenient):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict | bool | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None
    description: str | None = None

    @model_validator(mode="after")
    def _schema_when_asked(self):
        if self.type == "json_schema" and (self.schema_ is None or not self.name):
            raise ValueError('text.format of type "json_schema" needs a name and a schema')
        return self

    def grammar(self) -> str | None:
        if self.type == "json_object":
            return json_object_grammar()
        if self.type == "json_schema":
            return json_schema_grammar(self.schema_)
        return None


class ReasoningConfig(Lenient):
    """How hard the model thinks: "none" turns a thinking template's reasoning off (enable_thinking false, as
    Qwen3's template reads it); the other efforts leave the model as it is."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None


class TextConfig(Lenient):
    format: TextFormat | None = None


class ResponsesRequest(Lenient):
    model: str | None = None
    input: Annotated[str, Field(min_length=1)] | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, **BOUNDS["max_new_tokens"].field())
    temperature: float | None = Field(default=None, **BOUNDS["temperature"].field() | {"le": 2})
    top_p: float | None = Field(default=None, **BOUNDS["top_p"].field())
    tools: list[Annotated[Union[FunctionTool, OtherTool], Field(union_mode="left_to_right")]] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    parallel_tool_calls: StrictBool | None = None
    text: TextConfig | None = None
    stream: StrictBool = False
    store: StrictBool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    chat_template_kwargs: dict | None = None  # more of the template's variables (vLLM's field): enable_thinking, ...
    reasoning: ReasoningConfig | None = None

    @property
    def function_tools(self) -> list[FunctionTool]:
        return [t for t in self.tools or () if isinstance(t, FunctionTool)]

    @property
    def choice(self) -> str:
        """tool_choice as a Conversation says it: auto, none, required, or the function's name."""
        return self.tool_choice.name if isinstance(self.tool_choice, NamedFunction) else self.tool_choice or "auto"

    def turns(self) -> list[Turn]:
        """This request's input as turns: a message's text and the function calls after it are one assistant
        turn, each call's output a tool turn."""
        if isinstance(self.input, str):
            return [Turn("user", self.input)]
        turns: list[Turn] = []
        for item in self.input:
            if isinstance(item, MessageItem):
                turns.append(Turn("system" if item.role == "developer" else item.role, item.text))
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if turns and turns[-1].role == "assistant":  # a reply's text, then its calls: one turn
                    turns[-1] = Turn("assistant", turns[-1].content, (*turns[-1].calls, call))
                else:
                    turns.append(Turn("assistant", "", (call,)))
            elif isinstance(item, FunctionCallOutputItem):
                turns.append(Turn("tool", item.text, call_id=item.call_id))
        if not turns:
            raise InvalidParameter("input holds no message, call or call output")
        return turns

    def conversation(self, history: tuple[Turn, ...], tool_format: str) -> Conversation:
        """`history` (the turns of previous_response_id's conversation, its instructions not carried over, as
        OpenAI does), then this request's instructions and input."""
        system = [Turn("system", self.instructions)] if self.instructions else []
        return Conversation((*system, *history, *self.turns()), tuple(t.openai() for t in self.function_tools),
                            self.choice, self.parallel_tool_calls is not False, tool_format,
                            template_variables=self.template_variables)

    @property
    def template_variables(self) -> dict:
        """The chat template's extra variables: reasoning effort "none" as enable_thinking false, then
        chat_template_kwargs (which win)."""
        off = {"enable_thinking": False} if self.reasoning and self.reasoning.effort == "none" else {}
        return off | (self.chat_template_kwargs or {})

    def sampling(self, default_max_tokens: int, prompt: Prompt) -> SamplingParams:
        constraint = self.text.format.grammar() if self.text and self.text.format else None
        return SamplingParams(
            max_new_tokens=self.max_output_tokens or default_max_tokens,
            temperature=self.temperature if self.temperature is not None else 1.0,
            top_p=self.top_p if self.top_p is not None else 1.0,
            grammar=prompt.grammar(constraint),
        )
