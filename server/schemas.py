"""Request bodies: the TGI shape for /generate and the OpenAI shapes for /v1. Validation lives here."""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, field_validator, model_validator

from engine import SamplingParams
from engine.grammar import choice_grammar, json_object_grammar, json_schema_grammar, lark_grammar, regex_grammar
from engine.sampling import BOUNDS, InvalidParameter
from server.conversation import Conversation, Prompt, Turn


class Strict(BaseModel):
    # Unknown fields are errors that name them: a typo must not be silently ignored. Types are strict, as the
    # schema says: "stream": 0 or "false" is not a boolean, "min_p": false not a number, 2.0 not an integer
    # (an integer is still a number).
    model_config = ConfigDict(extra="forbid", strict=True)


class Lenient(BaseModel):
    # For the agents' APIs (Responses, Messages), whose clients send fields that change nothing a local server
    # does (beta flags, cache hints): unknown fields are ignored. Types stay strict.
    model_config = ConfigDict(extra="ignore", strict=True)


def unsupported(model: BaseModel, neutral: dict[str, tuple]) -> None:
    """Fields a client library sends at neutral values on every request: accepted only at those values."""
    for name, allowed in neutral.items():
        value = getattr(model, name)
        if value not in allowed:
            raise ValueError(f"{name}={value!r} is not supported by kvserve (accepted: {', '.join(map(repr, allowed))})")


class JSONSchemaFormat(Strict):
    name: str = Field(min_length=1, max_length=64)
    schema_: dict | bool = Field(default=True, alias="schema")  # OpenAI's field name; absent: any JSON
    strict: StrictBool | None = None  # the output always follows the schema: a grammar enforces it
    description: str | None = None


class ResponseFormat(Strict):
    """OpenAI's response_format: text, any JSON object, or JSON that follows a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_when_asked(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('response_format needs json_schema exactly when its type is "json_schema"')
        return self

    def grammar(self) -> str | None:
        if self.type == "json_object":
            return json_object_grammar()
        if self.type == "json_schema":
            return json_schema_grammar(self.json_schema.schema_)
        return None


class StructuredOutputs(Strict):
    """vLLM's structured_outputs: exactly one of a JSON schema, a regex, choices or a Lark grammar."""

    json_: dict | bool | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(default=None, min_length=1)
    grammar: str | None = None

    @model_validator(mode="after")
    def _exactly_one(self):
        if sum(v is not None for v in (self.json_, self.regex, self.choice, self.grammar)) != 1:
            raise ValueError("structured_outputs takes exactly one of json, regex, choice or grammar")
        return self

    def grammar_text(self) -> str:
        if self.json_ is not None:
            return json_schema_grammar(parsed_schema(self.json_))
        if self.regex is not None:
            return regex_grammar(self.regex)
        if self.choice is not None:
            return choice_grammar(self.choice)
        return lark_grammar(self.grammar)


def parsed_schema(value: dict | bool | str) -> dict | bool:
    """A JSON schema given as JSON or as a string holding JSON (clients send both)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise InvalidParameter(f"the JSON schema is not valid JSON: {e}") from None


class TGIGrammar(Strict):
    """TGI's parameters.grammar: {"type": "json", "value": schema} or {"type": "regex", "value": pattern}."""

    type: Literal["json", "regex"]
    value: dict | bool | str

    def grammar_text(self) -> str:
        if self.type == "json":
            return json_schema_grammar(parsed_schema(self.value))
        if not isinstance(self.value, str):
            raise InvalidParameter("a regex grammar's value must be a string")
        return regex_grammar(self.value)


class TGIParameters(Strict):
    max_new_tokens: int | None = Field(default=None, **BOUNDS["max_new_tokens"].field())
    temperature: float | None = Field(default=None, **BOUNDS["temperature"].field())
    top_k: int | None = Field(default=None, ge=-1)  # -1 or 0: off (vLLM clients send -1)
    top_p: float | None = Field(default=None, **BOUNDS["top_p"].field())
    min_p: float | None = Field(default=None, **BOUNDS["min_p"].field())
    repetition_penalty: float | None = Field(default=None, **BOUNDS["repetition_penalty"].field())
    frequency_penalty: float | None = Field(default=None, **BOUNDS["frequency_penalty"].field())
    do_sample: StrictBool = False
    seed: int | None = Field(default=None, **BOUNDS["seed"].field())
    stop: list[str] = Field(default_factory=list)
    details: StrictBool = False
    return_full_text: StrictBool | None = False
    truncate: int | None = Field(default=None, ge=1)
    top_n_tokens: int | None = Field(default=None, **BOUNDS["top_logprobs"].field())
    decoder_input_details: StrictBool = False  # the prompt tokens with their logprobs, in details.prefill
    parse_special: StrictBool = False  # special-token strings in `inputs` as special tokens; otherwise they are text
    best_of: int | None = Field(default=None, ge=1)  # sample this many, return the likeliest (not streamed)
    # TGI fields kvserve does not implement: their neutral values only.
    grammar: TGIGrammar | None = None  # the output follows a JSON schema or a regex
    # TGI fields kvserve does not implement: their neutral values only.
    watermark: StrictBool = False
    typical_p: float | None = None
    adapter_id: str | None = None

    @model_validator(mode="after")
    def _neutral(self):
        if (self.best_of or 1) > 1 and not self.samples:
            raise ValueError("best_of > 1 needs sampling (do_sample: true): greedy sequences would all be the same")
        unsupported(self, {"watermark": (False,), "typical_p": (None, 1.0), "adapter_id": (None, "")})
        return self

    @property
    def samples(self) -> bool:
        """As TGI: sampling when asked, or when any warper is set; otherwise greedy."""
        warped = (self.temperature not in (None, 1.0) or max(self.top_k or 0, 0) > 0 or (self.top_p or 1.0) < 1
                  or (self.min_p or 0) > 0)
        return (self.do_sample or warped) and self.temperature != 0

    def sampling(self, default_max_new_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=self.max_new_tokens or default_max_new_tokens,
            temperature=(self.temperature if self.temperature is not None else 1.0) if self.samples else 0.0,
            top_k=max(self.top_k or 0, 0),
            top_p=self.top_p if self.top_p is not None else 1.0,
            min_p=self.min_p or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            seed=self.seed,
            stop=tuple(self.stop),
            top_logprobs=self.top_n_tokens or 0,
            prompt_logprobs=self.decoder_input_details,
            grammar=self.grammar.grammar_text() if self.grammar else None,
        )


class GenerateRequest(Strict):
    inputs: str = Field(min_length=1)
    parameters: TGIParameters = Field(default_factory=TGIParameters)
    stream: StrictBool = False


class TokenizeRequest(Strict):
    """TGI's /tokenize body: the ids /generate would give `inputs` with these `parameters`."""

    inputs: str
    parameters: TGIParameters = Field(default_factory=TGIParameters)
    parse_special: StrictBool | None = None  # the extension field at the top level too, as on the OpenAI routes

    @property
    def special_tokens_parsed(self) -> bool:
        return self.parameters.parse_special if self.parse_special is None else self.parse_special


class DetokenizeRequest(Strict):
    """/detokenize (as vLLM's): token ids back to text."""

    tokens: list[Annotated[int, Field(ge=0)]]
    skip_special_tokens: StrictBool = False


class StreamOptions(Strict):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class OpenAISampling(BaseModel):
    """Fields common to completions and chat; unknown fields are errors, types strict (as Strict's)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    max_tokens: int | None = Field(default=None, **BOUNDS["max_new_tokens"].field())
    temperature: float | None = Field(default=None, **BOUNDS["temperature"].field() | {"le": 2})  # OpenAI's own cap
    top_p: float | None = Field(default=None, **BOUNDS["top_p"].field())
    n: int = Field(default=1, ge=1)  # choices: n sequences of one prompt, seeds seed, seed + 1, ...
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, **BOUNDS["seed"].field())
    presence_penalty: float | None = Field(default=None, **BOUNDS["presence_penalty"].field())
    frequency_penalty: float | None = Field(default=None, **BOUNDS["frequency_penalty"].field())
    user: str | None = None
    logit_bias: dict | None = None
    # Extensions, as vLLM offers them.
    top_k: int | None = Field(default=None, ge=-1)  # -1 or 0: off (vLLM clients send -1)
    min_p: float | None = Field(default=None, **BOUNDS["min_p"].field())
    repetition_penalty: float | None = Field(default=None, **BOUNDS["repetition_penalty"].field())
    ignore_eos: StrictBool = False
    # Special-token strings in the prompt or message text as special tokens; by default they are text, so a
    # user cannot type a chat turn or an end of text (the chat template's own markers are always special).
    parse_special: StrictBool = False
    # Structured output: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(default=None, min_length=1)
    guided_grammar: str | None = None

    @model_validator(mode="after")
    def _supported(self):
        unsupported(self, {"logit_bias": (None, {})})
        return self

    @property
    def top_alternatives(self) -> int:
        """Most likely tokens to report at each step, as this route's logprobs fields ask."""
        return 0

    @property
    def scores_prompt(self) -> bool:
        """Whether the response carries the prompt tokens' logprobs too."""
        return False

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def sampling(self, max_tokens: int | None, default_max_tokens: int, prompt: Prompt | None = None) -> SamplingParams:
        """The engine's parameters; with a chat prompt, its grammar (a forced tool call, after any reasoning) over the
        response format."""
        grammar = self.grammar() if prompt is None else prompt.grammar(self.grammar())
        return SamplingParams(
            max_new_tokens=max_tokens or default_max_tokens,
            temperature=self.temperature if self.temperature is not None else 1.0,
            top_p=self.top_p if self.top_p is not None else 1.0,
            top_k=max(self.top_k or 0, 0),
            min_p=self.min_p or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            seed=self.seed,
            stop=self.stops,
            ignore_eos=self.ignore_eos,
            top_logprobs=self.top_alternatives,
            prompt_logprobs=self.scores_prompt,
            grammar=grammar,
        )

    def grammar(self) -> str | None:
        """The grammar text of whichever structured-output field the request sets (one at most), or None."""
        legacy = {"json": self.guided_json, "regex": self.guided_regex, "choice": self.guided_choice,
                  "grammar": self.guided_grammar}
        legacy = {k: v for k, v in legacy.items() if v is not None}
        if len(legacy) > 1:
            raise InvalidParameter("set exactly one of guided_json, guided_regex, guided_choice and guided_grammar")
        formats = [f for f in (self.response_format and self.response_format.grammar(),
                               self.structured_outputs and self.structured_outputs.grammar_text(),
                               legacy and StructuredOutputs.model_validate(legacy).grammar_text()) if f]
        if len(formats) > 1:
            raise InvalidParameter("set one of response_format, structured_outputs and guided_*, not several")
        return formats[0] if formats else None


class CompletionRequest(OpenAISampling):
    # Text or token ids, one prompt per request (a list of one is accepted, as OpenAI's clients send it).
    prompt: (Annotated[str, Field(min_length=1)] | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=1)]
             | Annotated[list[int], Field(min_length=1)]
             | Annotated[list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1, max_length=1)])
    logprobs: int | None = Field(default=None, ge=0, le=5)  # the chosen token's logprob and up to 5 alternatives
    echo: StrictBool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt_said_plainly(cls, value, check):
        """The union's errors, one per alternative, said as the one thing that is wrong."""
        try:
            return check(value)
        except ValidationError:
            if value in ("", []) or value in ([""], [[]]):
                raise ValueError("prompt is empty") from None
            if isinstance(value, list) and len(value) > 1 and not isinstance(value[0], int):
                raise ValueError("send one prompt per request (a list of exactly one string or token list)") from None
            raise

    @model_validator(mode="after")
    def _one_prompt(self):
        if isinstance(self.prompt, list) and not isinstance(self.prompt[0], int):
            self.prompt = self.prompt[0]
        unsupported(self, {"suffix": (None, ""), "best_of": (None, 1)})
        return self

    @property
    def top_alternatives(self) -> int:
        return self.logprobs or 0

    @property
    def scores_prompt(self) -> bool:
        return self.echo and self.logprobs is not None  # echo with logprobs scores the echoed prompt, as vLLM does


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True)
    type: Literal["text"]
    text: str


class CalledFunction(BaseModel):
    model_config = ConfigDict(strict=True)
    name: str
    arguments: str  # JSON, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(strict=True)
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True)  # other fields a client sends with a message are ignored
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class FunctionDefinition(Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict | None = None  # a JSON schema for the arguments object
    strict: StrictBool | None = None  # the arguments always follow it when the call is enforced


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class ChosenFunction(Strict):
    name: str


class ToolChoice(Strict):
    type: Literal["function"]
    function: ChosenFunction


class ChatCompletionRequest(OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, **BOUNDS["max_new_tokens"].field())
    logprobs: StrictBool = False
    top_logprobs: int | None = Field(default=None, **BOUNDS["top_logprobs"].field())
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    chat_template_kwargs: dict | None = None  # more of the template's variables (vLLM's field): enable_thinking, ...

    @model_validator(mode="after")
    def _consistent(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def top_alternatives(self) -> int:
        return (self.top_logprobs or 0) if self.logprobs else 0

    def conversation(self, tool_format: str) -> Conversation:
        """The messages and tools as one Conversation; `tool_format`: how the served model writes calls."""
        turns = []
        for m in self.messages:
            calls = tuple(c.model_dump() for c in m.tool_calls or ())
            turns.append(Turn("system" if m.role == "developer" else m.role, m.text, calls, m.tool_call_id))
        choice = self.tool_choice.function.name if isinstance(self.tool_choice, ToolChoice) else self.tool_choice
        return Conversation(tuple(turns), tuple(t.model_dump(exclude_none=True) for t in self.tools or ()),
                            choice or "auto", self.parallel_tool_calls is not False, tool_format,
                            template_variables=self.chat_template_kwargs or {})
