"""Request bodies: the TGI shape for /generate and the OpenAI shapes for /v1. Validation lives here."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, field_validator, model_validator

from engine import SamplingParams
from engine.sampling import MAX_TOP_LOGPROBS


class Strict(BaseModel):
    # Unknown fields are errors that name them: a typo must not be silently ignored. Types are strict, as the
    # schema says: "stream": 0 or "false" is not a boolean, "min_p": false not a number, 2.0 not an integer
    # (an integer is still a number).
    model_config = ConfigDict(extra="forbid", strict=True)


def unsupported(model: BaseModel, neutral: dict[str, tuple]) -> None:
    """Fields a client library sends at neutral values on every request: accepted only at those values."""
    for name, allowed in neutral.items():
        value = getattr(model, name)
        if value not in allowed:
            raise ValueError(f"{name}={value!r} is not supported by kvserve (accepted: {', '.join(map(repr, allowed))})")


class TGIParameters(Strict):
    max_new_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_k: int | None = Field(default=None, ge=-1)  # -1 or 0: off (vLLM clients send -1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    do_sample: StrictBool = False
    seed: int | None = Field(default=None, ge=0)
    stop: list[str] = Field(default_factory=list)
    details: StrictBool = False
    return_full_text: StrictBool | None = False
    truncate: int | None = Field(default=None, ge=1)
    top_n_tokens: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    decoder_input_details: StrictBool = False  # the prompt tokens with their logprobs, in details.prefill
    parse_special: StrictBool = False  # special-token strings in `inputs` as special tokens; otherwise they are text
    best_of: int | None = Field(default=None, ge=1)  # sample this many, return the likeliest (not streamed)
    # TGI fields kvserve does not implement: their neutral values only.
    watermark: StrictBool = False
    typical_p: float | None = None
    grammar: Any = None
    adapter_id: str | None = None

    @model_validator(mode="after")
    def _neutral(self):
        if (self.best_of or 1) > 1 and not self.samples:
            raise ValueError("best_of > 1 needs sampling (do_sample: true): greedy sequences would all be the same")
        unsupported(self, {"watermark": (False,), "typical_p": (None, 1.0),
                           "grammar": (None,),
                           "adapter_id": (None, "")})
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
        )


class GenerateRequest(Strict):
    inputs: str = Field(min_length=1)
    parameters: TGIParameters = Field(default_factory=TGIParameters)
    stream: StrictBool = False


class TokenizeRequest(Strict):
    inputs: str
    parameters: dict | None = None


class StreamOptions(Strict):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class OpenAISampling(BaseModel):
    """Fields common to completions and chat; unknown fields are errors, types strict (as Strict's)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1)  # choices: n sequences of one prompt, seeds seed, seed + 1, ...
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    user: str | None = None
    logit_bias: dict | None = None
    # Extensions, as vLLM offers them.
    top_k: int | None = Field(default=None, ge=-1)  # -1 or 0: off (vLLM clients send -1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0)
    ignore_eos: StrictBool = False
    # Special-token strings in the prompt or message text as special tokens; by default they are text, so a
    # user cannot type a chat turn or an end of text (the chat template's own markers are always special).
    parse_special: StrictBool = False

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

    def sampling(self, max_tokens: int | None, default_max_tokens: int) -> SamplingParams:
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
        )


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


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True)  # other fields a client sends with a message (tool_calls) are ignored
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list | None = None
    tool_choice: Any = None
    response_format: dict | None = None
    parallel_tool_calls: StrictBool | None = None

    @model_validator(mode="after")
    def _neutral_fields(self):
        unsupported(self, {"tools": (None, []), "tool_choice": (None, "none"),
                           "parallel_tool_calls": (None, True, False)})
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.response_format not in (None, {"type": "text"}):
            raise ValueError("response_format other than {'type': 'text'} is not supported by kvserve")
        return self

    @property
    def top_alternatives(self) -> int:
        return (self.top_logprobs or 0) if self.logprobs else 0

    def rendered_messages(self) -> list[dict]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text} for m in self.messages]
