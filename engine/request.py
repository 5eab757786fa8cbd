"""One generation request and its progress through the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.drafts import MatchBudgets, NgramIndex
from engine.sampler import Choice
from engine.sampling import SamplingParams
from engine.tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from llguidance import LLMatcher


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    LENGTH = "length"  # max_new_tokens or the context length reached
    EOS = "eos"  # an end-of-sequence or stop token id
    STOP = "stop"  # a stop string appeared in the text
    ABORT = "abort"  # cancelled by the caller
    ERROR = "error"  # its own step failed (see RequestFailed); the other requests went on


@dataclass(frozen=True)
class Draft:
    """What speculative decoding did for one request in one step: `proposed` draft tokens by `method` (ngram,
    suffix, grammar), of which the first `accepted` were what the sampler produced there anyway."""

    method: str
    proposed: int
    accepted: int


@dataclass(frozen=True)
class TokenEvent:
    """One generated token, as the caller sees it."""

    request_id: str
    index: int  # position among the generated tokens, from 0
    token_id: int
    text: str  # the text this token completes; "" while a character is still incomplete
    logprob: float
    special: bool
    finish_reason: FinishReason | None = None
    stop_string: str | None = None  # which stop string ended the request, when one did
    top_logprobs: tuple[tuple[int, float], ...] = ()  # (token id, logprob) of the most likely tokens, best first
    # On a request's first event when it asked for prompt_logprobs: prompt tokens 1.. as scored by their prefix.
    prompt_logprobs: tuple[Choice, ...] | None = None
    reused_prompt_tokens: int | None = None  # on a request's first event: prompt tokens whose K/V were kept, not computed
    draft: Draft | None = None  # on the first event of a step that verified drafts for this request


@dataclass(frozen=True)
class RequestFailed:
    """The end of a request whose prefill or sampling failed while the rest of its batch went on."""

    request_id: str
    message: str
    by_grammar: bool = False  # the request's grammar failed (a limit of llguidance's): the client's schema, not us


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int  # with the number of tokens generated so far, all of the randomness of the next draw
    detokenizer: IncrementalDetokenizer | None
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    slot: int | None = None
    finish_reason: FinishReason | None = None
    prompt_logprobs: list[Choice] | None = None  # filled at prefill when params.prompt_logprobs
    reused_tokens: int = 0  # leading prompt tokens its slot already held at admission (prefix caching)
    prefilled: int = 0  # leading prompt tokens its slot holds: reused, then written chunk by chunk
    copy_from: int | None = None  # at admission: the running slot its reused tokens are copied from
    grammar: LLMatcher | None = None  # follows the output through params.grammar, when the request has one
    ngrams: NgramIndex | None = None  # its prompt and output, for drafts (speculative decoding): made at first use
    budget: MatchBudgets | None = None  # how many drafts it proposes, from its recent acceptance after each match

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def prompt_left(self) -> int:
        """Prompt tokens not yet written to its slot."""
        return len(self.prompt_ids) - self.prefilled

    @property
    def cached_tokens(self) -> int:
        """Positions written to the cache: every token but the newest, which the next decode feeds."""
        return self.num_tokens - 1 if self.output_ids else self.prefilled

    @property
    def text(self) -> str:
        return self.detokenizer.text if self.detokenizer else ""

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
