"""Sampling parameters and the pure tensor functions that turn logits into tokens."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


MAX_TOP_LOGPROBS = 20  # alternatives per token, as OpenAI's chat API allows
# Below this temperature sampling is greedy (vLLM's rule): dividing logits by a smaller one overflows
# float32 to inf, and the softmax of an inf row is NaN.
GREEDY_TEMPERATURE = 1e-5
# Repetition penalties are applied no further from 1 than this: a logit divided by a penalty of
# 1e-40 (0 in float32) would be inf. Beyond it every penalized token is as good as banned anyway.
PENALTY_RANGE = (1e-4, 1e4)


class InvalidParameter(ValueError):
    """A sampling or request parameter outside its valid range; the message says which and why."""


@dataclass(frozen=True)
class Bounds:
    """A parameter's valid range: the one source of truth for SamplingParams' checks and the HTTP schemas."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def holds(self, value: float) -> bool:
        return (math.isfinite(value) and (self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt))

    def field(self) -> dict[str, float]:
        """As pydantic's Field takes them."""
        return {k: v for k, v in (("ge", self.ge), ("gt", self.gt), ("le", self.le), ("lt", self.lt)) if v is not None}

    def describe(self) -> str:
        def number(v: float) -> str:
            return f"{v:g}" if isinstance(v, float) else str(v)

        low = f"[{number(self.ge)}" if self.ge is not None else f"({number(self.gt)}" if self.gt is not None else None
        high = f"{number(self.le)}]" if self.le is not None else f"{number(self.lt)})" if self.lt is not None else None
        if low is None or high is None:  # one-sided: said as a comparison
            return next(f"{op} {number(v)}" for op, v in ((">=", self.ge), (">", self.gt), ("<=", self.le), ("<", self.lt))
                        if v is not None)
        return f"in {low}, {high}"


BOUNDS = {  # every numeric sampling parameter's range (the APIs map their own spellings onto these)
    "max_new_tokens": Bounds(ge=1),
    "temperature": Bounds(ge=0),
    "top_k": Bounds(ge=0),
    "top_p": Bounds(gt=0, le=1),
    "min_p": Bounds(ge=0, le=1),
    "repetition_penalty": Bounds(gt=0),
    "presence_penalty": Bounds(ge=-2, le=2),
    "frequency_penalty": Bounds(ge=-2, le=2),
    "seed": Bounds(ge=0, lt=2**63),
    "top_logprobs": Bounds(ge=0, le=MAX_TOP_LOGPROBS),
}
INTEGERS = ("max_new_tokens", "top_k", "seed", "top_logprobs")
NOTES = {"temperature": " (0 = greedy)", "top_k": " (0 = off)", "repetition_penalty": " (1 = off)"}


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 1.0  # 0 (or below GREEDY_TEMPERATURE) means greedy
    top_k: int = 0  # 0 means no top-k filter
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # multiplicative, over prompt and output tokens (CTRL / HF)
    presence_penalty: float = 0.0  # additive, over output tokens (OpenAI)
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    top_logprobs: int = 0  # the most likely tokens to report, with logprobs, at each step
    prompt_logprobs: bool = False  # also score every prompt token (with top_logprobs alternatives) at prefill
    grammar: str | None = None  # llguidance grammar text the output must follow (engine/grammar.py makes it)

    def __post_init__(self) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise InvalidParameter(message)

        for name, bounds in BOUNDS.items():
            value = getattr(self, name)
            if name == "seed" and value is None:
                continue
            whole = not isinstance(value, bool) and (isinstance(value, int) if name in INTEGERS else
                                                     isinstance(value, (int, float)))
            kind = "an integer " if name in INTEGERS else ""
            check(whole and bounds.holds(value), f"{name} must be {kind}{bounds.describe()}{NOTES.get(name, '')}, "
                                                 f"got {value!r}")
        check(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings")
        check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids must be token ids >= 0")
        check(isinstance(self.top_logprobs, int) and 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS,
              f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}")
        check(self.grammar is None or (isinstance(self.grammar, str) and self.grammar != ""),
              "grammar must be a non-empty grammar text")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    def ends_at(self, token: int, eos_token_ids: tuple[int, ...]) -> bool:
        """Whether `token` ends the request: one of its stop token ids, or an end-of-sequence id it does not ignore."""
        return token in self.stop_token_ids or (not self.ignore_eos and token in eos_token_ids)

    @property
    def has_filters(self) -> bool:
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """logits (b, V); seen (b, V) bool: tokens in prompt or output; penalty (b,).

    A seen token's positive logit is divided by the penalty, a negative one multiplied, so a
    penalty > 1 always makes it less likely.
    """
    p = penalty.clamp(*PENALTY_RANGE)[:, None]
    penalized = torch.where(logits > 0, logits / p, logits * p)
    return torch.where(seen, penalized, logits)


def apply_additive_penalties(logits: torch.Tensor, counts: torch.Tensor, presence: torch.Tensor,
                             frequency: torch.Tensor) -> torch.Tensor:
    """OpenAI's penalties: counts (b, V) of each token in the output so far; presence, frequency (b,)."""
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0)


def top_k_filter(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Keep each row's k largest logits (k (b,), 0 = keep all); the rest become -inf.

    The k-th largest from a partial selection of the largest max(k) (topk), not a sort of the whole vocabulary: 16
    rows of 49,152 logits sorted took 29 ms, more than the step that made them."""
    vocab = logits.shape[-1]
    k = torch.where(k > 0, k, vocab).clamp(max=vocab)
    limited = k < vocab  # rows that drop anything
    if not bool(limited.any()):
        return logits
    largest = logits.topk(int(k[limited].max()), dim=-1).values  # (b, max k), largest first
    kth_largest = largest.gather(-1, (k.clamp(max=largest.shape[-1]) - 1)[:, None])  # (b, 1)
    kth_largest = torch.where(limited[:, None], kth_largest, float("-inf"))  # the others keep every token
    return logits.masked_fill(logits < kth_largest, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches p (b,); always the top one; a row with
    p >= 1 keeps every token.

    First only the 512 most likely tokens are ordered (topk), and the whole vocabulary only where some row's nucleus
    is wider: a sort took 2 ms a row of 49,152 tokens, where a trained model's nucleus is rarely more than a few
    hundred tokens."""
    vocab = logits.shape[-1]
    active = p < 1
    probs = logits.softmax(dim=-1)
    for size in (min(vocab, 512), vocab):
        top, order = probs.topk(size, dim=-1)  # (b, size), most likely first
        mass = top.cumsum(dim=-1)
        if bool(((mass[:, -1] >= p) | ~active).all()):  # every active row's nucleus ends inside
            break
    mass_before = mass - top  # probability of strictly more likely tokens
    drop_sorted = (mass_before >= p[:, None]) & active[:, None]
    drop_sorted[:, 0] = False  # a p that rounds to 0 in float32 (1e-300) must still keep the best token
    kept = logits.gather(-1, order).masked_fill(drop_sorted, float("-inf"))  # (b, size)
    filtered = torch.full_like(logits, float("-inf")).scatter_(-1, order, kept)  # past the size: dropped
    return torch.where(active[:, None], filtered, logits)


def min_p_filter(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens less likely than min_p (b,) times the most likely token's probability."""
    probs = logits.softmax(dim=-1)
    threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))


def _signed(constant: int) -> int:
    """A 64-bit constant as the int64 torch stores (two's complement)."""
    return constant - (1 << 64) if constant >= 1 << 63 else constant


SPLITMIX = [_signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)]


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic: it copies the sign bit)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def uniform(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """(b,) float32 in (0, 1), never 0 or 1: a pure function of each row's seed and step.

    A counter-based generator (splitmix64 over seed and step; int64 arithmetic wraps), so a row draws the same
    number alone or in any batch, on any device, with no generator state to carry.
    """
    x = seeds * SPLITMIX[0] + steps * SPLITMIX[1]
    x = (x ^ _shift_right(x, 30)) * SPLITMIX[1]
    x = (x ^ _shift_right(x, 27)) * SPLITMIX[2]
    x = x ^ _shift_right(x, 31)
    return (_shift_right(x, 40).float() + 0.5) / (1 << 24)  # top 24 bits


def draw(scores: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """One token per row from softmax(scores) (b, V): the first token whose cumulative weight passes the row's
    uniform number times the total (inverse transform sampling: one random number per row, not one per token).

    Weights are exp(scores - max): the best token weighs 1, nothing overflows, and a filtered token (-inf) weighs 0,
    so the cumulative sum is flat across it and no draw lands on it. A token more than 87 below the best (odds
    under 1e-37) weighs 0 too: exp's results below float32's smallest normal number take it many times longer,
    and low temperatures put most of a vocabulary there. The target stays below the total, so some token with
    weight always passes it.
    """
    # In place after the first: each new (b, V) float32 tensor costs as much again as the arithmetic on it.
    weights = scores - scores.max(dim=-1, keepdim=True).values  # (b, V), at most 0
    negligible = weights < -87.0
    weights.clamp_(min=-87.0).exp_().masked_fill_(negligible, 0.0)
    cumulative = weights.cumsum_(dim=-1)  # (b, V), non-decreasing
    total = cumulative[:, -1:]  # (b, 1), at least 1
    target = torch.minimum(uniform(seeds, steps)[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    token = torch.searchsorted(cumulative, target, right=True)[:, 0]  # first cumulative weight above the target
    return token.clamp(max=scores.shape[-1] - 1)  # a row with no finite score (NaN throughout) stays in range
