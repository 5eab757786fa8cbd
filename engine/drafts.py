"""Draft tokens for speculative decoding, guessed without a second model.

A draft is only a guess: the engine runs it through the model beside the row's last token and keeps the
longest prefix that the plain sampler would have produced anyway (engine.Engine._verify), so no method here
can change what a request gets, only how many of its tokens one step emits.

- `NgramIndex` (prompt lookup): where the last n tokens occurred before in the request's own prompt and output, the
  tokens that followed them then. The newest 4 tokens' earlier occurrences are told apart by how far back each
  agrees with the newest tokens (up to MAX_MATCH), so that text that repeats with variations (a loop of two phrases
  that end alike, code edited in one place) follows the occurrence that matches most; else the latest occurrence
  of the newest 3 tokens. After a match of only 2 or 1 tokens (a word, a bracket, a line's indent: they recur
  everywhere) no one occurrence says much, so the draft follows what most of them continued with, token by
  token, as far as two of them agree: a frequency-scored path through the continuations, as suffix decoding
  scores its tree.
- `SuffixCorpus`: the same lookup over the outputs of recently finished requests, bounded in tokens, so that an
  agent's repeated tool calls and boilerplate are drafted from earlier replies (the earlier reply that agrees with
  the newest tokens furthest back, where several share them).
- Grammar-forced tokens come from the request's grammar (llguidance's forced tokens) in the engine itself.
- `DraftBudget`: how many drafts a request proposes, from its recent acceptance: free text, where guesses keep
  failing, falls back to plain decoding steps. `MatchBudgets` keeps one per method and length of the match the
  drafts follow, since a longer match is right far more often.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

SPECULATIVE_MODES = ("off", "ngram", "suffix", "auto")
NGRAM_SIZES = (4, 3, 2, 1)  # longest match first: a longer context predicts its continuation better
MAX_PAUSE = 32  # steps a request drafts nothing after its drafts failed repeatedly, at most
MAX_MATCH = 32  # tokens a match of the newest tokens is followed back, at most
MATCH_CANDIDATES = 16  # the latest earlier occurrences of the newest tokens compared, at most
SHORT_MATCH = 2  # matches of at most this many tokens are drafted by their occurrences' common continuation

Place = int | tuple[int, int]  # where an n-gram ended: an index in one list, or (list id, index)


def ngrams_ending(tokens: list[int], end: int) -> list[tuple[int, ...]]:
    """The n-grams (n in NGRAM_SIZES, those that fit) whose last token is tokens[end]."""
    return [tuple(tokens[end - n + 1: end + 1]) for n in NGRAM_SIZES if end - n + 1 >= 0]


def agreement(tokens: list[int], end: int, context: list[int]) -> int:
    """How many tokens of `tokens` ending at index `end` equal the last ones of `context`, in order, up to MAX_MATCH."""
    n = 0
    while n < MAX_MATCH and n <= end and n < len(context) and tokens[end - n] == context[-1 - n]:
        n += 1
    return n


def record(tokens: list[int], end: int, place: Place, occurrences: dict) -> None:
    """The n-grams ending at tokens[end] as ending at `place`, after their earlier places."""
    for key in ngrams_ending(tokens, end):
        occurrences.setdefault(key, []).append(place)


def common_continuation(places: list[Place], tokens_at: Callable[[Place], tuple[list[int], int]], k: int) -> list[int]:
    """Up to k tokens that most of `places` (n-gram ends, oldest first) were followed by, token by token: each the
    one most of the places still in agreement continued with (the latest's among equals), past the first only
    where two or more did, and those places go on."""
    found = [tokens_at(place) for place in places]
    drafts: list[int] = []
    while len(drafts) < k:
        j = len(drafts) + 1
        votes: dict[int, tuple[int, int]] = {}  # token -> (places continued with it, the latest's rank)
        for rank, (tokens, end) in enumerate(found):
            if end + j < len(tokens):
                token = tokens[end + j]
                votes[token] = (votes.get(token, (0, 0))[0] + 1, rank)
        if not votes:
            break
        token, (count, _) = max(votes.items(), key=lambda vote: vote[1])
        if drafts and count < 2:
            break
        drafts.append(token)
        found = [(tokens, end) for tokens, end in found if end + j < len(tokens) and tokens[end + j] == token]
    return drafts


def draft_from(context: list[int], occurrences: dict, tokens_at: Callable[[Place], tuple[list[int], int]],
               k: int) -> tuple[int, list[int]]:
    """(n, up to k tokens) guessed to follow `context` from the places its newest n-grams ended (`record`; n of the
    newest tokens agree), or (0, []): of the latest MATCH_CANDIDATES places of its newest 4 tokens, the one whose
    tokens (tokens_at(place): a list and the index there) agree with the context furthest back, the latest among
    equals, and what followed it; else the latest place of its newest 3; else the common continuation of its
    newest 2's or 1's latest places."""
    for n in NGRAM_SIZES:
        places = occurrences.get(tuple(context[-n:])) if len(context) >= n else None
        if not places:
            continue
        if n == NGRAM_SIZES[0]:
            n, place = max((agreement(*tokens_at(place), context), place) for place in places[-MATCH_CANDIDATES:])
        elif n > SHORT_MATCH:
            place = places[-1]
        else:
            return n, common_continuation(places[-MATCH_CANDIDATES:], tokens_at, k)
        tokens, end = tokens_at(place)
        return n, tokens[end + 1: end + 1 + k]
    return 0, []


@dataclass
class NgramIndex:
    """For every n-gram (n in NGRAM_SIZES) of a token list, where it ended, kept as the list grows.

    `propose` looks up the n-grams that end at the newest token among those that ended earlier (draft_from): each
    position is indexed once the next token exists, so the newest n-gram never matches itself, and a match's
    continuation always has at least one token.
    """

    tokens: list[int] = field(default_factory=list)
    occurrences: dict[tuple[int, ...], list[int]] = field(default_factory=dict)  # n-gram -> its ends, in order

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            end = len(self.tokens) - 1  # the previous newest token now has a successor
            record(self.tokens, end, end, self.occurrences)
            self.tokens.append(token)

    def propose(self, k: int) -> tuple[int, list[int]]:
        """(n, up to k tokens) guessed to follow the newest tokens, n of which matched earlier ones; (0, []) if
        they match none."""
        return draft_from(self.tokens, self.occurrences, lambda end: (self.tokens, end), max(k, 0))


class SuffixCorpus:
    """The token lists of recently finished requests (prompt and output), indexed as NgramIndex is, at most
    `max_tokens` tokens in all: the oldest lists are dropped first (and their n-grams with them)."""

    def __init__(self, max_tokens: int):
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        self.max_tokens = max_tokens
        self._lists: OrderedDict[int, list[int]] = OrderedDict()  # id -> tokens, oldest first
        self._occurrences: dict[tuple[int, ...], list[tuple[int, int]]] = {}  # n-gram -> (list id, end), oldest first
        self._ids = 0
        self.tokens = 0  # held in all

    def add(self, tokens: list[int]) -> None:
        tokens = tokens[-self.max_tokens:] if self.max_tokens else []
        if len(tokens) < 2:
            return
        while self._lists and self.tokens + len(tokens) > self.max_tokens:
            self._drop_oldest()
        self._ids += 1
        self._lists[self._ids] = tokens
        self.tokens += len(tokens)
        for end in range(len(tokens) - 1):  # the last token has no successor to propose
            record(tokens, end, (self._ids, end), self._occurrences)

    def _drop_oldest(self) -> None:
        list_id, tokens = self._lists.popitem(last=False)
        self.tokens -= len(tokens)
        for key in {key for end in range(len(tokens) - 1) for key in ngrams_ending(tokens, end)}:
            places = self._occurrences[key]
            oldest = next((i for i, place in enumerate(places) if place[0] != list_id), len(places))
            if oldest == len(places):
                del self._occurrences[key]
            else:
                del places[:oldest]  # the oldest list's places come first: lists are added in order

    def propose(self, context: list[int], k: int) -> tuple[int, list[int]]:
        """(n, up to k tokens) guessed to follow `context`'s newest tokens from the held lists, as NgramIndex
        guesses from its own (draft_from); (0, []) if they match none."""
        return draft_from(context, self._occurrences, lambda place: (self._lists[place[0]], place[1]), max(k, 0))


@dataclass
class StepCosts:
    """A decode step's seconds as a line in the rows it runs, seconds = fixed + per_row * rows, fit by least squares
    to the steps seen, older ones weighing less (each step multiplies the weights by `decay`).

    On a CPU a row more costs little where a step is bound by reading the weights (a 1B model) and a third of a
    step where it is bound by compute (a 135M one on 2 cores): the fit tells which this engine is, on this machine.
    """

    decay: float = 0.98
    sums: list[float] = field(default_factory=lambda: [0.0] * 5)  # weight, rows, seconds, rows^2, rows * seconds

    def observe(self, rows: int, seconds: float) -> None:
        self.sums = [s * self.decay + term for s, term in zip(self.sums, (1, rows, seconds, rows * rows, rows * seconds))]

    def line(self) -> tuple[float, float] | None:
        """(fixed, per_row) seconds, or None until steps of different row counts were seen."""
        w, x, y, xx, xy = self.sums
        spread = w * xx - x * x
        if w == 0 or spread <= 1e-9 * max(1.0, w * xx):
            return None
        per_row = (w * xy - x * y) / spread
        return (y - per_row * x) / w, per_row

    def threshold(self, batch: int) -> float:
        """The chance of acceptance a draft row must have to pay for itself in a step of `batch` requests: the
        tokens it adds per second it costs (p / per_row) at least the step's own rate (batch / seconds). 0 (any
        draft) until the costs are known, so that a first verification measures them."""
        line = self.line()
        if line is None:
            return 0.0
        fixed, per_row = line
        if per_row <= 0:
            return 0.0
        return min(1.0, per_row * batch / max(fixed + per_row * batch, per_row * batch))


@dataclass
class Outcomes:
    """Verified draft positions, older ones weighing less (each update multiplies them by `decay`): a kept draft is
    right, the first rejected one wrong. Starts from a prior of one of each: a chance of 1/2 before any is verified."""

    decay: float = 0.95
    right: float = 1.0
    wrong: float = 1.0

    @property
    def chance(self) -> float:
        """That a draft is right."""
        return self.right / (self.right + self.wrong)

    def update(self, proposed: int, accepted: int) -> None:
        if proposed:
            self.right = self.right * self.decay + accepted
            self.wrong = self.wrong * self.decay + (accepted < proposed)


@dataclass
class DraftBudget:
    """How many drafts one request proposes in a step, from how often its drafts were right and what a draft costs.

    The j-th draft of a step is kept with the chance that a draft is right (Outcomes) to the power j, so a step
    proposes drafts while that is above StepCosts.threshold. Where no draft pays (free text, a large batch), one
    is still proposed now and then (after 1, 2, 4 ... steps, up to MAX_PAUSE; a right one halves the pause), so
    that a request whose text turns predictable (a quote, a repeated call) is drafted again.
    """

    limit: int
    outcomes: Outcomes = field(default_factory=Outcomes)
    wait: int = 0  # steps until the next probe, while no draft pays
    every: int = 1  # steps between probes

    @property
    def chance(self) -> float:
        return self.outcomes.chance

    def allowed(self, threshold: float) -> int:
        """Drafts this step may propose (0: none); counts a step without."""
        k = 0
        while k < self.limit and self.chance ** (k + 1) > threshold:
            k += 1
        if k:
            return k
        if self.wait > 0:
            self.wait -= 1
            return 0
        self.wait = self.every
        self.every = min(MAX_PAUSE, self.every * 2)
        return 1

    def update(self, proposed: int, accepted: int) -> None:
        self.outcomes.update(proposed, accepted)
        if accepted:  # halved, not reset: in free text one probe in several is right by chance
            self.every = max(1, self.every // 2)


def match_class(n: int) -> int:
    """The matches of n tokens that share a budget: 1, 2 and 3 each their own, then 4-7, 8-15, 16-31 and 32."""
    return n if n <= 4 else 1 << (n.bit_length() - 1)


@dataclass
class MatchBudgets:
    """A request's DraftBudget for each method and length of the match its drafts follow (match_class).

    How often drafts are right depends on how much context matched far more than on the request: in the default
    model's output of the bench's tasks, drafts after a match of 4 tokens were kept 94% of the time in a code edit
    and 5 of 6 in free text, after a match of 1 token 23% and 8%. One chance for all would either waste rows on
    single-token matches or forgo long ones; each length learning its own drafts only where its matches pay.
    A length seen for the first time starts from the request's own drafts so far, all lengths pooled (as much
    weight as the first prior's two outcomes): in free text, where every length fails, each new one would
    otherwise spend its first rows finding that out again. `update` counts the outcome of the drafts `allowed`
    last sized.
    """

    limit: int
    budgets: dict[tuple[str, int], DraftBudget] = field(default_factory=dict)
    last: tuple[str, int] | None = None  # the (method, class of n) whose drafts are being verified
    pooled: Outcomes = field(default_factory=Outcomes)  # every length's: the prior of a length not seen yet

    def allowed(self, method: str, n: int, threshold: float) -> int:
        """Drafts this step may propose after a match of n tokens by `method` (0: none)."""
        self.last = (method, match_class(n))
        if self.last not in self.budgets:
            chance = self.pooled.chance
            self.budgets[self.last] = DraftBudget(self.limit, Outcomes(right=2 * chance, wrong=2 * (1 - chance)))
        return self.budgets[self.last].allowed(threshold)

    def update(self, proposed: int, accepted: int) -> None:
        if self.last is not None:
            self.budgets[self.last].update(proposed, accepted)
            self.pooled.update(proposed, accepted)
