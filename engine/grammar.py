"""Constrained decoding: a grammar forbids tokens, per row, before a token is drawn.

llguidance (the library vLLM and llama.cpp use) compiles a JSON schema, a regex or a Lark grammar against the
model's own tokenizer, and for each step of a sequence gives the set of tokens that keep its text inside the
grammar, one bit per token; a matcher then follows the tokens drawn. It runs on a plain logits tensor, needs
nothing but its wheel, and computes a mask in tens of microseconds.

A request carries its grammar as llguidance's grammar text (`SamplingParams.grammar`, made by the functions
below). `Grammars.compile` builds a matcher once per grammar text and keeps it; each request then follows a copy.
The server compiles on a worker thread when it admits a request, so the engine thread only copies.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Any

import torch
from llguidance import LLMatcher, LLParserLimits, LLTokenizer

from engine.json_schema import checked
from engine.sampling import InvalidParameter

# llguidance's default bounds on a grammar's size and work per step, without its parser state in error messages
# (kilobytes of it, which are no client's business).
LIMITS = LLParserLimits(verbose_errors=False)
COMPILED_KEPT = 256  # grammars kept compiled, least recently used first out
# JSON without free whitespace between tokens: with it, a weak model under greedy decoding may emit spaces
# forever and never close the object.
COMPACT_JSON = {"whitespace_flexible": False}


def json_schema_grammar(schema: dict[str, Any] | bool) -> str:
    """Grammar text for JSON values that match `schema` (True or {}: any JSON value), compact; InvalidParameter
    for a schema that llguidance refuses or that no finite value matches (engine/json_schema.py)."""
    if schema is True:
        schema = {}
    try:
        return LLMatcher.grammar_from_json_schema(json.dumps(checked(schema)), defaults=COMPACT_JSON)
    except ValueError as e:
        raise InvalidParameter(f"invalid JSON schema: {e}") from None


def json_object_grammar() -> str:
    """Any JSON object (OpenAI's response_format "json_object")."""
    return json_schema_grammar({"type": "object"})


def regex_grammar(pattern: str) -> str:
    return LLMatcher.grammar_from_regex(pattern)


def lark_grammar(text: str) -> str:
    """A Lark grammar (llguidance's variant), as given."""
    return LLMatcher.grammar_from_lark(text)


def choice_grammar(choices: list[str]) -> str:
    """Exactly one of `choices`."""
    if not choices:
        raise InvalidParameter("choices must hold at least one string")
    return regex_grammar("|".join(f"({re.escape(choice)})" for choice in choices))


class Grammars:
    """Compiles grammars for one tokenizer and keeps the compiled matchers, by grammar text; thread-safe."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...]):
        # The model's vocabulary may be wider than the tokenizer's (padding rows): those tokens are never allowed.
        self.tokenizer = LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids))
        self.vocab_size = vocab_size
        self._compiled: OrderedDict[str, LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, grammar: str) -> LLMatcher:
        """The compiled matcher of `grammar`, at its start (not to be advanced: copy it); InvalidParameter if invalid."""
        with self._lock:
            if grammar in self._compiled:
                self._compiled.move_to_end(grammar)
                return self._compiled[grammar]
        # Seconds at worst, bounded by llguidance's limits (grammar size, lexer fuel); it drops the GIL.
        matcher = LLMatcher(self.tokenizer, grammar, log_level=0, limits=LIMITS)
        first = matcher.deep_copy()
        first.compute_bitmask()  # the first step's mask, as decoding will ask for it: errors that only show then
        for failed in (matcher, first):
            if failed.is_error():
                raise InvalidParameter(f"invalid grammar: {short(failed.get_error())}")
        with self._lock:
            self._compiled[grammar] = matcher
            while len(self._compiled) > COMPILED_KEPT:
                self._compiled.popitem(last=False)
        return matcher

    def start(self, grammar: str) -> LLMatcher:
        """A matcher of its own for one sequence, at the grammar's start."""
        return self.compile(grammar).deep_copy()

    def forced(self, matcher: LLMatcher) -> list[int]:
        """Tokens to draft where the grammar fixes what comes next: llguidance's forced tokens (the only tokens it
        allows), then the bytes it forces past them split as the tokenizer splits them. The grammar fixes those bytes,
        not their tokens: the model may spell them in other tokens (`":` then `"` for `":"`), or merge the last with
        what follows (`["` for `[`), so these are drafts that may fail, where forced tokens never do."""
        tokens = matcher.compute_ff_tokens()
        spelled = bytes(self.tokenizer.decode_bytes(tokens))
        forced = matcher.compute_ff_bytes()
        if len(forced) <= len(spelled) or not forced.startswith(spelled):
            return tokens
        return tokens + self.tokenizer.tokenize_bytes(forced[len(spelled):])


def short(error: str) -> str:
    """llguidance's error message without the parser state it may append (a block from a line that opens "<")."""
    return " ".join(error.split("\n<", 1)[0].split())[:1000]


def bitmask(matcher: LLMatcher) -> torch.Tensor:
    """(words,) int32: bit j of word w set iff the matcher allows token 32·w + j next (maybe one spare word)."""
    return torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32)


def allows(mask: torch.Tensor, token: int) -> bool:
    return 0 <= token >> 5 < len(mask) and bool((int(mask[token >> 5]) >> (token & 31)) & 1)


def bitmasks_along(matcher: LLMatcher, tokens: list[int]) -> list[torch.Tensor]:
    """The matcher's mask before tokens[0], and after each of `tokens` that it takes while another may follow: up to
    the first it refuses, or the one that completes it (nothing may follow but EOS). The matcher ends where it began."""
    masks, taken = [bitmask(matcher)], 0
    try:
        while taken < len(tokens) and allows(masks[-1], tokens[taken]) and matcher.consume_token(tokens[taken]):
            taken += 1
            if matcher.is_stopped():
                break
            masks.append(bitmask(matcher))
    finally:
        if taken:
            matcher.rollback(taken)
    return masks


def allowed_tokens(matchers: list[LLMatcher | None], vocab_size: int, device: torch.device) -> torch.Tensor | None:
    """(b, W) int32 bitmasks: the tokens each row's grammar allows next (every token for a row without one); None if
    no row has one."""
    return allowed_from([bitmask(m) if m is not None else None for m in matchers], vocab_size, device)


def allowed_from(masks: list[torch.Tensor | None], vocab_size: int, device: torch.device) -> torch.Tensor | None:
    """(b, W) int32 from each row's bitmask (None: every token allowed), W words enough for `vocab_size` tokens and
    every mask; None if no row has one. Bit j of word w is token 32·w + j (the sampler's `masked` reads them)."""
    if not any(mask is not None for mask in masks):
        return None
    words = max((vocab_size + 31) // 32, *(len(mask) for mask in masks if mask is not None))
    bits = torch.full((len(masks), words), -1, dtype=torch.int32)  # (b, words): all allowed
    for row, mask in enumerate(masks):
        if mask is not None:
            bits[row, :len(mask)] = mask
    return bits.to(device)
