"""Turns one step's logits into one token per sequence, each with its own parameters."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np
import torch

from engine.linear.native import kernels_run_on
from engine.sampling import (
    SamplingParams,
    apply_additive_penalties,
    apply_repetition_penalty,
    draw,
    min_p_filter,
    top_k_filter,
    top_p_filter,
    uniform,
)


class SamplingState(Protocol):
    params: SamplingParams
    seed: int  # with len(output_ids), all the randomness of a row's next draw
    prompt_ids: list[int]
    output_ids: list[int]


@dataclass(frozen=True)
class Choice:
    """One row's next token, its log-probability, and the row's `top_logprobs` most likely tokens, best first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def select_tokens(logits: torch.Tensor, rows: Sequence[SamplingState],
                  allowed: torch.Tensor | None = None) -> list[Choice]:
    """logits (b, V) float32 -> each row's next token, with log-probabilities under the model.

    `allowed` (b, W) int32, when given, holds the only tokens each row may take (its grammar's), before any
    other filter, as llguidance's bitmasks: bit j of word w is token 32·w + j. Log-probabilities are the model's
    own (before grammars, penalties, temperature and filters), as OpenAI and TGI report them. A row of non-finite
    logits raises: the model failed on it, and no token drawn from it would mean anything.
    """
    best, log_norm = normalize(logits)
    scores = logits if allowed is None else masked(logits, allowed)
    scores = _penalize(scores, rows) if any(r.params.has_penalties for r in rows) else scores
    greedy_filtered = scores is not logits and any(r.params.greedy for r in rows)
    tokens = first_max(scores) if greedy_filtered else best  # unfiltered rows: the max already found it
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    if len(sampled) == len(rows):  # every row: no copy of the rows out (indexing copied 16 rows in 0.4 ms)
        tokens = _sample(scores, rows)
    elif sampled:
        at = torch.tensor(sampled, device=scores.device)
        tokens[at] = _sample(scores.index_select(0, at), [rows[i] for i in sampled])
    return score(logits, tokens, [r.params.top_logprobs for r in rows], log_norm)


def by_kernel(scores: torch.Tensor) -> bool:
    """Whether kvserve's sampler kernels take these (b, V) scores: float32, where the kernels run."""
    return kernels_run_on(scores.device) and scores.dtype == torch.float32


def normalize(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (b, V) -> each row's most likely token (b,) and its log-sum-exp (b,), from one pass for the max.

    By kvserve's kernel where it runs (engine/linear/native/log_norm.cpp): torch's max over a vocabulary is a
    scalar loop, and the kernel computes each row alone, so a row's bits do not depend on the rows beside it.
    Raises where a log-sum-exp is not finite: a NaN or +inf logit, or no finite one in the row.
    """
    if by_kernel(logits):
        best, log_norm = torch.ops.kvserve.log_norm(logits.contiguous())
    else:
        top, best = logits.max(dim=-1)  # (b,): the first maximum, as argmax
        log_norm = top + (logits - top[:, None]).exp_().sum(dim=-1).log_()  # shifted by the max: no overflow
    if not torch.isfinite(log_norm).all():
        raise FloatingPointError("the model produced non-finite logits")
    return best, log_norm


def masked(logits: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """logits (b, V) with -inf wherever a row's bitmask words (b, W) int32 leave a token's bit clear."""
    if by_kernel(logits):
        return torch.ops.kvserve.masked_logits(logits.contiguous(), words.contiguous())
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    allowed = (words[:, :, None] >> shifts) & 1  # (b, W, 32): bit j of word w is token 32·w + j
    allowed = allowed.reshape(len(words), -1)[:, :logits.shape[-1]].bool()  # (b, 32·W) -> (b, V)
    return logits.masked_fill(~allowed, float("-inf"))


def first_max(scores: torch.Tensor) -> torch.Tensor:
    """scores (b, V) -> each row's first index of its maximum (argmax's), by kvserve's kernel where it runs (torch's
    argmax over a vocabulary is a scalar loop: 0.35 ms for 11 rows)."""
    if by_kernel(scores):
        return torch.ops.kvserve.first_max(scores.contiguous())
    return scores.argmax(dim=-1)


def score(logits: torch.Tensor, tokens: torch.Tensor, wanted: Sequence[int],
          log_norm: torch.Tensor | None = None) -> list[Choice]:
    """logits (b, V), tokens (b,) -> each token's log-probability and its row's `wanted[row]` most likely tokens.

    log_norm (b,): each row's log-sum-exp, when the caller has it already.
    """
    # log softmax where it is read only: a logit minus its row's log-sum-exp.
    log_norm = logits.logsumexp(dim=-1) if log_norm is None else log_norm
    chosen = logits.gather(-1, tokens[:, None])[:, 0] - log_norm
    tops: list[tuple[tuple[int, float], ...]] = [()] * len(tokens)
    if max(wanted, default=0):
        values, ids = logits.topk(max(wanted), dim=-1)  # (b, n), best first
        values = (values - log_norm[:, None]).tolist()
        tops = [tuple(zip(i[:n], v[:n])) for i, v, n in zip(ids.tolist(), values, wanted)]
    return [Choice(*c) for c in zip(tokens.tolist(), chosen.tolist(), tops)]


def _penalize(logits: torch.Tensor, rows: Sequence[SamplingState]) -> torch.Tensor:
    """The rows' penalties, computed on the logits of the tokens each row saw (prompt and output) and written back
    over a copy: every other logit is left as it is by both penalties (a count of 0 subtracts 0). Over the whole
    (b, V), torch's `where` on a sign mask took 1.4 ms for 16 rows, and the penalties 16-18 ms in all."""
    device = logits.device
    seen = [r.prompt_ids + r.output_ids for r in rows]
    width = max(1, max(map(len, seen)))
    # Padded by repeating the row's first token: a duplicate writes the same value as the original, so the order
    # of the writes does not matter. A row that saw nothing points at token 0 and changes nothing.
    ids = id_tensor([row + row[:1] * (width - len(row)) if row else [0] * width for row in seen], device)  # (b, n)
    any_seen = torch.tensor([[bool(row)] for row in seen], device=device).expand(-1, width)  # (b, n)
    counts = token_counts(logits, [r.output_ids for r in rows]).gather(-1, ids)  # (b, n): counts in the output
    values = apply_repetition_penalty(logits.gather(-1, ids), any_seen, column(rows, "repetition_penalty", device))
    values = apply_additive_penalties(values, counts, column(rows, "presence_penalty", device),
                                      column(rows, "frequency_penalty", device))
    return logits.clone().scatter_(-1, ids, values)


def token_counts(like: torch.Tensor, ids: Sequence[list[int]]) -> torch.Tensor:
    """(b, V) float32: how often each token id occurs in each row's list, from one padded tensor."""
    width = max(1, max(map(len, ids)))
    padded = id_tensor([row + [-1] * (width - len(row)) for row in ids], like.device)  # -1 past the end
    # Added, not assigned: a padding entry (clamped to id 0) adds 0 and cannot hide a real token 0.
    return torch.zeros_like(like, dtype=torch.float32).scatter_add_(-1, padded.clamp(min=0), (padded >= 0).float())


def id_tensor(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    """(b, n) int64 from rows of equal length, through numpy: torch.tensor takes about 120 ns an element of nested
    lists (1.9 ms for 16 rows of 900 tokens), numpy a seventh of that."""
    return torch.from_numpy(np.array(rows, dtype=np.int64).reshape(len(rows), -1)).to(device)


def column(rows: Sequence[SamplingState], name: str, device: torch.device) -> torch.Tensor:
    """One sampling parameter of every row, as a (b,) tensor."""
    return torch.tensor([getattr(r.params, name) for r in rows], device=device)


def _sample(scores: torch.Tensor, rows: Sequence[SamplingState]) -> torch.Tensor:
    device = scores.device
    params = [r.params for r in rows]
    scores = scores / column(rows, "temperature", device)[:, None]
    if any(p.top_k > 0 for p in params):  # a k past the vocabulary (even past int64) keeps every token
        scores = top_k_filter(scores, torch.tensor([min(p.top_k, scores.shape[-1]) for p in params], device=device))
    if any(p.top_p < 1 for p in params):
        scores = top_p_filter(scores, column(rows, "top_p", device))
    if any(p.min_p > 0 for p in params):
        scores = min_p_filter(scores, column(rows, "min_p", device))
    seeds_and_steps = torch.tensor([[r.seed, len(r.output_ids)] for r in rows], device=device)  # (b, 2)
    return draw_tokens(scores, seeds_and_steps[:, 0], seeds_and_steps[:, 1])


def draw_tokens(scores: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """`draw`'s token per row (b, V) -> (b,), by kvserve's kernel where it runs (engine/linear/native/draw.cpp: the
    same rule, its sums in float64; 0.35 ms a row in torch's form, most of a sampled step's sampling)."""
    if by_kernel(scores):
        return torch.ops.kvserve.draw(scores.contiguous(), uniform(seeds, steps))
    return draw(scores, seeds, steps)
