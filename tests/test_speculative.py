"""Speculative decoding never changes what a request gets (tiny random models, transformers as the greedy oracle,
the real server over a socket), and its parts do what they say (pure tests of the drafters and the policy)."""

from __future__ import annotations

import json
from dataclasses import replace
import re

import httpx
import jsonschema
import pytest
import torch

from engine import EngineConfig, SamplingParams
from engine.drafts import (MAX_MATCH, MAX_PAUSE, DraftBudget, MatchBudgets, NgramIndex, StepCosts, SuffixCorpus,
                           match_class)
from engine.grammar import bitmasks_along, json_schema_grammar, regex_grammar
from tests.server_harness import serve
from weights.loading import load_engine

REPEATING = [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7]  # a prompt whose n-grams recur
PROMPTS = [REPEATING, [3, 4, 3, 4, 3, 4, 3], [11, 12, 13, 14, 15, 16], [40, 41, 42, 40, 41]]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "tags": {"type": "array", "items": {"enum": ["red", "green"]},
                                                    "maxItems": 3}},
          "required": ["name", "tags"], "additionalProperties": False}


def engine_for(model_dir, speculative: str = "off", **settings):
    settings = dict(device="cpu", dtype="float32", max_batch_size=4, max_seq_len=512, seed=0) | settings
    return load_engine(model_dir("long"), EngineConfig(speculative=speculative, **settings))


def drafting_always(engine):
    """Every draft is worth verifying: the policy's cost fit, which times this machine, is fixed at zero cost, so
    that the tests see drafts on every step where a drafter has one, whatever the machine's timings."""
    engine.step_costs.threshold = lambda batch: 0.0
    return engine


def drafting_wrong(engine, monkeypatch):
    """A test hook in place of the drafters: each step guesses 3 tokens the sampler never picks here."""
    vocab = engine.model.config.vocab_size
    monkeypatch.setattr(engine, "_draft", lambda request, threshold: (
        "ngram", [(request.output_ids[-1] * 7 + j) % vocab for j in range(1, 4)]))
    return engine


def run(engine, prompts, params):
    """Every request to its end through Engine.step; (output ids by request, drafts reported by request, steps)."""
    requests = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    tokens = {r.request_id: [] for r in requests}
    logprobs = {r.request_id: [] for r in requests}
    drafts = {r.request_id: [] for r in requests}
    steps = 0
    while engine.has_work:
        steps += 1
        for event in engine.step():
            tokens[event.request_id].append(event.token_id)
            logprobs[event.request_id].append((event.logprob, event.top_logprobs))
            if event.draft is not None:
                drafts[event.request_id].append(event.draft)
    ids = [r.request_id for r in requests]
    return [tokens[i] for i in ids], [logprobs[i] for i in ids], [drafts[i] for i in ids], steps


# ---- the parts ----------------------------------------------------------------------------------------------


def test_ngram_index_proposes_what_followed_the_latest_longest_match():
    index = NgramIndex()
    index.extend([1, 2, 3, 9, 1, 2, 3, 4, 5, 1, 2, 3])
    assert index.propose(3) == (3, [4, 5, 1])  # "1 2 3" last ended at index 6 (before the newest), then came 4 5
    assert NgramIndex().propose(4) == (0, [])
    fresh = NgramIndex()
    fresh.extend([7, 8])
    assert fresh.propose(4) == (0, [])  # "8" never occurred before: nothing to propose
    fresh.extend([7])
    assert fresh.propose(4) == (1, [8])  # "7" occurred once: its next token; no second occurrence agrees past it


def test_a_short_match_drafts_what_most_of_its_occurrences_continued_with():
    """After a match of one token (a bracket, an indent), its latest occurrence says little: the draft follows the
    continuation most of its occurrences share, token by token, as far as two of them agree."""
    index = NgramIndex()
    index.extend([20, 1, 5, 6, 9, 21, 1, 5, 7, 9, 22, 1, 5, 6, 8, 23, 1])  # "23 1" is new; "1" came 3 times
    assert index.propose(4) == (1, [5, 6])  # 5 after all three, then 6 after two; 9 and 8 after one each
    index.extend([5, 7])  # "1 5 7" came once (ending at 8): a match of 3 tokens drafts what followed it whole
    assert index.propose(4) == (3, [9, 22, 1, 5])
    tie = NgramIndex()
    tie.extend([30, 1, 5, 31, 1, 6, 32, 1])
    assert tie.propose(4) == (1, [6])  # one vote each: the latest occurrence's


def test_ngram_index_follows_the_occurrence_that_agrees_furthest_back():
    """A loop of two phrases that end alike ("so the n-gram itself is the n-gram itself, so ..."): the newest 4
    tokens occurred twice, and the longer context tells which continuation is the loop's."""
    index = NgramIndex()
    index.extend([5, 1, 2, 3, 4, 7, 6, 1, 2, 3, 4, 8, 5, 1, 2, 3, 4])
    # "5 1 2 3 4" ended at 4, followed by 7 6 1; the latest "1 2 3 4" (at 10) agrees for 4 tokens only
    assert index.propose(3) == (5, [7, 6, 1])
    index.extend([7, 6, 1, 2, 3, 4])  # the occurrence ending at 10 now agrees back to the first token: 11
    assert index.propose(1) == (11, [8])
    repeated = NgramIndex()
    repeated.extend([9] * (MAX_MATCH + 10))
    assert repeated.propose(1) == (MAX_MATCH, [9])  # as long as MAX_MATCH at most
    assert [match_class(n) for n in (1, 3, 4, 7, 8, 31, 32)] == [1, 3, 4, 4, 8, 16, 32]


def test_suffix_corpus_drafts_from_finished_lists_within_its_bound():
    corpus = SuffixCorpus(max_tokens=10)
    corpus.add([1, 2, 3, 4, 5, 6])
    assert corpus.propose([9, 2, 3], 3) == (2, [4])  # one occurrence of "2 3": its next token
    corpus.add([20, 21, 22, 23, 24, 25])  # 12 tokens > 10: the first list goes, and its n-grams with it
    assert corpus.tokens == 6 and corpus.propose([2, 3], 3) == (0, [])
    assert corpus.propose([21, 22], 2) == (2, [23])
    corpus.add([30, 21, 22, 99])  # the same n-gram in a newer list wins; dropping the older keeps the newer's
    assert corpus.propose([21, 22], 1) == (2, [99])
    corpus.add(list(range(100, 130)))  # longer than the bound: only its last 10 tokens are kept
    assert corpus.tokens == 10 and corpus.propose([124, 125], 2) == (2, [126])
    assert corpus.propose([0, 123, 124, 125], 3) == (3, [126, 127, 128])  # 3 tokens: the latest occurrence's
    assert corpus.propose([21, 22], 1) == (0, [])
    calls = SuffixCorpus(max_tokens=100)  # two earlier replies share "1 2 3 4"; what came before tells them apart
    calls.add([7, 1, 2, 3, 4, 50, 51])
    calls.add([8, 1, 2, 3, 4, 60, 61])
    assert calls.propose([7, 1, 2, 3, 4], 2) == (5, [50, 51]) and calls.propose([9, 1, 2, 3, 4], 2) == (4, [60, 61])
    calls.add(list(range(200, 288)))  # 102 tokens: the first reply goes, its occurrence of "1 2 3 4" with it
    assert calls.propose([7, 1, 2, 3, 4], 2) == (4, [60, 61])


def test_step_costs_fit_the_line_and_price_a_draft_row():
    costs = StepCosts()
    assert costs.line() is None and costs.threshold(1) == 0.0  # unknown: draft, to measure
    for rows, seconds in [(1, 0.010), (5, 0.026), (1, 0.010), (3, 0.018)]:
        costs.observe(rows, seconds)
    fixed, per_row = costs.line()
    assert fixed == pytest.approx(0.006) and per_row == pytest.approx(0.004)
    assert costs.threshold(1) == pytest.approx(0.4)  # 4 ms buys a token at 1 per 10 ms if kept 40% of the time
    assert costs.threshold(16) == pytest.approx(0.064 / 0.070)  # a large batch: drafts must nearly always hold


def test_draft_budget_drafts_what_pays_and_probes_where_nothing_does():
    budget = DraftBudget(limit=4)
    assert budget.chance == 0.5 and budget.allowed(threshold=0.3) == 1  # 0.5 > 0.3 > 0.25
    for _ in range(6):
        budget.update(proposed=4, accepted=4)
    assert budget.allowed(threshold=0.3) == 4
    for _ in range(40):
        budget.update(proposed=4, accepted=0)
    assert budget.chance < 0.3
    # Nothing pays: a single probe, then 1, 2, 4 ... steps without, up to MAX_PAUSE.
    pattern = [budget.allowed(threshold=0.3) for _ in range(1 + 1 + 1 + 2 + 1 + 4 + 1)]
    assert pattern == [1, 0, 1, 0, 0, 1, 0, 0, 0, 0, 1]
    budget.every = MAX_PAUSE
    budget.update(proposed=1, accepted=1)  # a probe that was right: probes come twice as often
    assert budget.every == MAX_PAUSE // 2


def test_each_length_of_match_learns_its_own_chance():
    budgets = MatchBudgets(limit=4)
    for _ in range(40):  # drafts after single-token matches keep failing, after four-token ones keep holding
        if k := budgets.allowed("ngram", 1, threshold=0.3):
            budgets.update(proposed=k, accepted=0)
        if k := budgets.allowed("ngram", 4, threshold=0.3):
            budgets.update(proposed=k, accepted=k)
    assert budgets.budgets["ngram", 1].chance < 0.1 < 0.9 < budgets.budgets["ngram", 4].chance
    assert budgets.allowed("ngram", 4, threshold=0.3) == 4
    assert [budgets.allowed("ngram", 1, threshold=0.3) for _ in range(3)].count(0) >= 1  # probes only


def test_a_length_not_seen_yet_starts_from_the_requests_own_drafts():
    """Free text: drafts after every length fail, so a new length starts where the others ended (probes only);
    a code edit: they hold, so a new length drafts as much as pays at once."""
    failing, holding = MatchBudgets(limit=4), MatchBudgets(limit=4)
    assert failing.allowed("ngram", 1, threshold=0.2) == 2  # the first prior: a chance of 1/2 (0.25 > 0.2 > 0.125)
    for n in (1, 2, 3, 1, 2, 3):
        if k := failing.allowed("ngram", n, threshold=0.2):
            failing.update(proposed=k, accepted=0)
        if k := holding.allowed("ngram", n, threshold=0.2):
            holding.update(proposed=k, accepted=k)
    assert failing.pooled.chance < 0.2 < 0.8 < holding.pooled.chance
    assert failing.allowed("suffix", 8, threshold=0.2) == 1 and failing.budgets["suffix", 8].chance < 0.2  # a probe
    assert holding.allowed("suffix", 8, threshold=0.2) == 4


# ---- the engine: the output is the output without speculation ------------------------------------------------


@pytest.mark.parametrize("speculative", ["ngram", "suffix", "auto"])
def test_greedy_output_is_transformers_greedy_output(model_dir, hf_model, speculative):
    engine = drafting_always(engine_for(model_dir, speculative))
    params = [SamplingParams(max_new_tokens=48, temperature=0, ignore_eos=True)] * len(PROMPTS)
    if speculative == "suffix":  # the corpus drafts from finished requests: the same prompts once before
        run(engine, PROMPTS, params)
    got, _, drafts, _ = run(engine, PROMPTS, params)
    model = hf_model(model_dir("long"))
    for prompt, tokens in zip(PROMPTS, got):
        want = model.generate(torch.tensor([prompt]), max_new_tokens=48, do_sample=False, min_new_tokens=48)
        assert tokens == want[0, len(prompt):].tolist()
    kept = sum(d.accepted for ds in drafts for d in ds)
    assert kept > 0 and {d.method for ds in drafts for d in ds} == {"suffix" if speculative == "suffix" else "ngram"}


def test_forgetting_replies_drafts_a_repeated_request_from_its_own_history(model_dir):
    engine = drafting_always(engine_for(model_dir, "suffix"))
    params = [SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)]
    first, _, _, _ = run(engine, PROMPTS[:1], params)
    again, _, drafts, _ = run(engine, PROMPTS[:1], params)  # drafted from its first reply
    assert again == first and sum(d.accepted for ds in drafts for d in ds) > 0
    engine.forget_replies()
    assert engine.speculation["suffix_tokens"] == 0
    anew, _, drafts, _ = run(engine, PROMPTS[:1], params)  # suffix drafts come only from finished requests: none
    assert anew == first and not any(drafts)


def test_sampled_penalized_and_stopped_outputs_and_logprobs_are_unchanged_in_a_mixed_batch(model_dir):
    params = [SamplingParams(max_new_tokens=40, temperature=1.0, seed=3, top_logprobs=3),
              SamplingParams(max_new_tokens=40, temperature=0.8, top_k=20, top_p=0.9, repetition_penalty=1.3,
                             presence_penalty=0.5, frequency_penalty=0.3, seed=5),
              SamplingParams(max_new_tokens=40, temperature=0, stop=("ab",), top_logprobs=2),
              SamplingParams(max_new_tokens=7, temperature=0.7, min_p=0.05, seed=11)]
    plain, plain_logprobs, _, _ = run(engine_for(model_dir), PROMPTS, params)
    engine = drafting_always(engine_for(model_dir, "ngram"))
    fast, fast_logprobs, drafts, _ = run(engine, PROMPTS, params)
    assert fast == plain
    for want, got in zip(plain_logprobs, fast_logprobs):  # the model's own, for every emitted token
        assert [lp for lp, _ in got] == pytest.approx([lp for lp, _ in want], abs=1e-4)
        assert [[t for t, _ in top] for _, top in got] == [[t for t, _ in top] for _, top in want]
    assert sum(d.accepted for ds in drafts for d in ds) > 0


def test_drafts_that_are_always_wrong_or_always_right_change_nothing(model_dir, monkeypatch):
    params = [SamplingParams(max_new_tokens=30, temperature=0.9, seed=i) for i in range(len(PROMPTS))]
    plain, _, _, plain_steps = run(engine_for(model_dir), PROMPTS, params)
    wrong = drafting_wrong(engine_for(model_dir, "ngram"), monkeypatch)
    got, _, drafts, _ = run(wrong, PROMPTS, params)
    assert got == plain and sum(d.proposed for ds in drafts for d in ds) > 0
    right = engine_for(model_dir, "ngram")
    answers = {tuple(p): a for p, a in zip(PROMPTS, plain)}
    monkeypatch.setattr(right, "_draft", lambda request, threshold: (
        "ngram", answers[tuple(request.prompt_ids)][len(request.output_ids): len(request.output_ids) + 3] or None))
    got, _, drafts, steps = run(right, PROMPTS, params)
    assert got == plain and steps <= plain_steps // 3
    assert all(d.accepted == d.proposed for ds in drafts for d in ds)


def test_drafts_a_grammar_refuses_or_completes_with_change_nothing(model_dir, monkeypatch):
    """Under a schema, sampled: drafts the grammar refuses (always wrong) and drafts that are the object itself, up
    to the token that completes it and EOS (always right), give the objects plain decoding gives."""
    grammar = json_schema_grammar(SCHEMA)
    prompts = ["Describe:", "Describe one:", "Describe two:"]
    params = [SamplingParams(max_new_tokens=80, temperature=1.0, seed=seed, grammar=grammar) for seed in range(3)]
    plain, _, _, plain_steps = run(engine_for(model_dir), prompts, params)
    assert run(drafting_wrong(engine_for(model_dir, "ngram"), monkeypatch), prompts, params)[0] == plain
    right = engine_for(model_dir, "ngram")
    answers = {tuple(right.tokenizer.encode(p)): a for p, a in zip(prompts, plain)}
    monkeypatch.setattr(right, "_draft", lambda request, threshold: (
        "ngram", answers[tuple(request.prompt_ids)][len(request.output_ids): len(request.output_ids) + 3] or None))
    got, _, drafts, steps = run(right, prompts, params)
    assert got == plain and steps <= plain_steps // 3
    assert all(d.accepted == d.proposed for ds in drafts for d in ds)


def test_bitmasks_along_drafts_stop_where_the_grammar_does_and_leave_it_unchanged(model_dir):
    grammars = engine_for(model_dir).grammars
    matcher = grammars.start(regex_grammar("ab(c|d)"))
    spelled = grammars.tokenizer.tokenize_bytes(b"abc")
    before = bytes(matcher.compute_bitmask())
    assert len(bitmasks_along(matcher, spelled)) == len(spelled)  # the last token completes it: no mask after
    refused = grammars.tokenizer.tokenize_bytes(b"abx")
    assert len(bitmasks_along(matcher, refused)) == len(grammars.tokenizer.tokenize_bytes(b"ab")) + 1
    assert bytes(matcher.compute_bitmask()) == before and not matcher.is_error()


def test_a_schema_gets_its_forced_tokens_drafted_and_the_same_object(model_dir):
    grammar = json_schema_grammar(SCHEMA)
    params = [SamplingParams(max_new_tokens=120, temperature=1.0, seed=seed, grammar=grammar) for seed in range(3)]
    plain, _, _, _ = run(engine_for(model_dir), ["Describe:"] * 3, params)
    got, _, drafts, _ = run(engine_for(model_dir, "ngram"), ["Describe:"] * 3, params)
    assert got == plain
    forced = [d for ds in drafts for d in ds if d.method == "grammar"]
    # Every one kept: the tiny tokenizer spells the schema's keys and punctuation a byte a token, as forced.
    assert forced and sum(d.accepted for d in forced) == sum(d.proposed for d in forced)


def test_a_grammar_drafts_the_bytes_it_fixes_past_its_forced_tokens(model_dir):
    """Where the grammar fixes bytes that more than one split into tokens spells ("Paris is the c" of "capital" or
    "city": " c" may start a longer token), llguidance forces only the tokens before them; the drafts go on with
    the tokenizer's split of the rest."""
    grammars = engine_for(model_dir).grammars
    matcher = grammars.start(regex_grammar("Paris is the (capital|city)"))
    tokens, drafts = matcher.compute_ff_tokens(), grammars.forced(matcher)
    assert drafts[:len(tokens)] == tokens and len(drafts) > len(tokens)
    assert bytes(grammars.tokenizer.decode_bytes(drafts)) == b"Paris is the c"
    matcher.consume_tokens(drafts[:-1])
    assert grammars.forced(matcher)[-1] == drafts[-1]  # and from a state partway through them



def test_a_forced_run_longer_than_k_is_verified_in_one_step_with_the_same_object(model_dir, monkeypatch):
    """Forced tokens always pass, so a step takes a whole forced run (up to Engine.forced_limit), not K of it: with
    K = 1 the schema's runs (`{"name": "`, `", "tags": [`) come as drafts of more than one token, the object is
    the one plain decoding gives, in fewer steps than with K of them a step. A full batch still fits its rows."""
    grammar = json_schema_grammar(SCHEMA)
    params = [SamplingParams(max_new_tokens=120, temperature=1.0, seed=seed, grammar=grammar) for seed in range(4)]
    plain, _, _, _ = run(engine_for(model_dir), ["Describe:"] * 4, params)
    engine = engine_for(model_dir, "ngram", num_speculative_tokens=1)
    assert engine.forced_limit > 1
    forward, rows = engine.executor.forward, []
    monkeypatch.setattr(engine.executor, "forward", lambda tokens, *rest: rows.append(len(tokens)) or forward(tokens, *rest))
    got, _, drafts, _ = run(engine, ["Describe:"] * 4, params)
    assert got == plain
    assert max(rows) <= engine.executor.rows  # 4 slots x (1 + K): runs past K are cut to K where they would not fit
    forced = [d for ds in drafts for d in ds if d.method == "grammar"]
    assert max(d.proposed for d in forced) > 1 and all(d.accepted == d.proposed for d in forced)
    _, _, _, steps_whole = run(engine_for(model_dir, "ngram", num_speculative_tokens=1), ["Describe:"], params[:1])
    monkeypatch.setattr(type(engine), "forced_limit", property(lambda self: 1))  # the old cap: K forced tokens a step
    _, _, _, steps_capped = run(engine_for(model_dir, "ngram", num_speculative_tokens=1), ["Describe:"], params[:1])
    assert steps_whole < steps_capped

def test_verified_rows_have_the_logits_of_tokens_decoded_one_by_one(model_dir):
    engine = engine_for(model_dir, "ngram")
    prompt, follow = [5, 6, 7, 8, 9, 10], [11, 12, 13, 14]
    with torch.inference_mode():
        slot = engine.scheduler.borrow()
        list(engine._forward_prompt(prompt[:-1], slot))
        at = len(prompt) - 1
        rows = engine.executor.forward([prompt[-1], *follow], [slot] * 5, [at + j for j in range(5)])
        one_by_one = torch.cat([engine.executor.forward([t], [slot], [at + j])
                                for j, t in enumerate([prompt[-1], *follow])])
        # Within float32's rounding: torch's dense float32 products (this model's) sum in another order for one row
        # than for five; kvserve's kernels (a quantized model's) give the same bits.
        assert torch.allclose(rows, one_by_one, atol=1e-5)
        prefill = engine.prompt_logits(prompt + follow)[len(prompt) - 1:]
        assert torch.allclose(rows, prefill, atol=1e-4)


def test_verification_through_the_padded_steps_cuda_captures(model_dir):
    """On CUDA a step is a captured graph padded to a batch size; the CPU runs the same padded steps eagerly."""
    params = [SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)] * 3
    plain, _, _, _ = run(engine_for(model_dir), PROMPTS[:3], params)
    padded = drafting_always(engine_for(model_dir, "ngram", num_speculative_tokens=3))
    padded.executor.capture(graphs=False)
    assert padded.executor.captured.batch_sizes[-1] == 4 * 4  # every slot verifying 3 drafts: 16 rows
    got, _, drafts, _ = run(padded, PROMPTS[:3], params)
    assert got == plain and sum(d.accepted for ds in drafts for d in ds) > 0


@pytest.mark.parametrize("kernel", [True, False])
def test_sliding_window_rings_hold_the_drafts_and_change_nothing(model_dir, monkeypatch, kernel):
    """A ring keeps its window W and the K positions a verifying step writes past the newest token (C = W + K).
    Greedy and sampled outputs, with drafts always right and always wrong, are those of the ring without
    speculation (itself transformers' in test_parity): long past the window of 4, in a batch, read by kvserve's
    attention kernel or by torch's attention over the ring's mask."""
    settings = dict(device="cpu", dtype="float32", max_batch_size=4, max_seq_len=96, seed=0)
    params = [SamplingParams(max_new_tokens=60, temperature=0, ignore_eos=True)] * 2 + [
        SamplingParams(max_new_tokens=60, temperature=0.9, seed=i, ignore_eos=True) for i in range(2)]

    def ring(speculative: str):
        engine = load_engine(model_dir("gemma3"), EngineConfig(speculative=speculative, **settings))
        engine.executor.reads_cache &= kernel  # False: torch's attention over the ring's mask, as on CUDA
        return engine

    unchanged = ring("off")
    plain, _, _, plain_steps = run(unchanged, PROMPTS, params)
    drafting = drafting_always(ring("ngram"))
    assert drafting.speculation["method"] == "ngram"
    assert drafting.cache.ring_capacity == unchanged.cache.ring_capacity + 4 == 4 + 4  # W + K
    got, _, drafts, _ = run(drafting, PROMPTS, params)
    assert got == plain and sum(d.proposed for ds in drafts for d in ds) > 0
    assert run(drafting_wrong(ring("ngram"), monkeypatch), PROMPTS, params)[0] == plain
    right = ring("ngram")
    answers = {tuple(p): a for p, a in zip(PROMPTS, plain)}
    monkeypatch.setattr(right, "_draft", lambda request, threshold: (
        "ngram", answers[tuple(request.prompt_ids)][len(request.output_ids): len(request.output_ids) + 3] or None))
    got, _, drafts, steps = run(right, PROMPTS, params)
    assert got == plain and steps <= plain_steps // 3
    assert all(d.accepted == d.proposed for ds in drafts for d in ds)


def test_a_slot_whose_ring_took_drafts_is_reused_only_where_it_lost_nothing(model_dir, monkeypatch):
    """A request that stops at a token drafts were verified beside leaves their K/V past its length: at positions
    7..9 of a ring of 7 (W = 4, K = 3), on the entries of positions 0..2. Its slot, holding 7 positions (more
    than W), is then reused only whole: a request sharing 3 of them gets the log-probabilities of an engine that
    never drafted."""
    settings = dict(device="cpu", dtype="float32", max_batch_size=1, max_seq_len=64, seed=0)
    first, second = [5, 6, 7, 8, 9, 10], [5, 6, 7, 30, 31]
    fresh = load_engine(model_dir("gemma3"), EngineConfig(**settings))
    greedy = SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True, top_logprobs=1)
    sampled = SamplingParams(max_new_tokens=20, temperature=1.0, seed=2, ignore_eos=True)
    (answer,), _, _, _ = run(fresh, [first], [sampled])
    assert answer[1] != answer[0]
    stopping = replace(sampled, stop_token_ids=(answer[1],))  # the first decode step's token ends it
    drafting = drafting_wrong(load_engine(model_dir("gemma3"), EngineConfig(speculative="ngram", **settings)), monkeypatch)
    (stopped,), _, (drafts,), _ = run(drafting, [first], [stopping])
    assert stopped == answer[:2] and drafts[0].proposed == 3  # the step at position 6 verified drafts at 7..9
    _, (got,), _, _ = run(drafting, [second], [greedy])
    _, (want,), _, _ = run(fresh, [second], [greedy])
    assert [lp for lp, _ in got] == pytest.approx([lp for lp, _ in want], abs=1e-5)


def test_engine_config_checks_the_speculative_settings():
    with pytest.raises(ValueError, match="speculative must be one of"):
        EngineConfig(speculative="eagle")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(speculative="ngram", num_speculative_tokens=0)


# ---- the server ---------------------------------------------------------------------------------------------


def test_the_server_reports_drafts_and_answers_as_without_them(model_dir):
    prompt = "a b c a b c a b c a b"
    tgi = {"inputs": prompt, "parameters": {"max_new_tokens": 24, "details": True, "do_sample": False}}
    chat = {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": 120, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}
    answers = {}
    for speculative in ("off", "auto"):
        with serve(model_dir("long"), speculative=speculative) as running, httpx.Client(base_url=running.url,
                                                                                          timeout=60) as client:
            if speculative != "off":
                drafting_always(running.runner.engine)
            generated = client.post("/generate", json=tgi).json()
            chatted = client.post("/v1/chat/completions", json=chat).json()
            responded = client.post("/v1/responses", json={"model": "m", "input": prompt, "max_output_tokens": 24,
                                                            "temperature": 0}).json()
            messaged = client.post("/v1/messages", json={"model": "m", "max_tokens": 24, "temperature": 0,
                                                          "messages": [{"role": "user", "content": prompt}]}).json()
            answers[speculative] = (generated["generated_text"], chatted["choices"][0]["message"]["content"],
                                    responded["output_text"], messaged["content"][0]["text"])
            responses_drafts = responded["usage"]["output_tokens_details"]
            messages_usage = messaged["usage"]
            info = client.get("/info").json()["speculative_decoding"]
            metrics = client.get("/metrics").text
            details, usage = generated["details"], chatted["usage"]["completion_tokens_details"]
    assert answers["auto"] == answers["off"]
    jsonschema.validate(json.loads(answers["auto"][1]), SCHEMA)
    assert info["method"] == "auto" and info["num_speculative_tokens"] == 4 and info["accepted_tokens"] > 0
    assert details["draft_tokens"] >= details["accepted_draft_tokens"] > 0
    assert usage["accepted_prediction_tokens"] > 0 and usage["rejected_prediction_tokens"] >= 0
    assert responses_drafts["accepted_prediction_tokens"] + responses_drafts["rejected_prediction_tokens"] > 0
    assert messages_usage["draft_tokens"] >= messages_usage["accepted_draft_tokens"]
    assert messages_usage["draft_tokens"] > 0

    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^{name}_total{{[^}}]*}} (\S+)$", metrics, re.M))

    kept = total("kvserve_spec_decode_accepted_tokens")
    assert kept >= details["accepted_draft_tokens"] + usage["accepted_prediction_tokens"]
    assert total("kvserve_spec_decode_draft_tokens") >= kept
    assert total("kvserve_spec_decode_accepted_tokens_per_position") == kept
    assert 'kvserve_spec_decode_accepted_tokens_total{method="grammar"}' in metrics
