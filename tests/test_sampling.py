"""Sampling as pure tensor functions, seeds, and parameter validation."""

from __future__ import annotations

import math

import pytest
import torch

from engine import InvalidParameter, SamplingParams
from engine.linear.native import load_kernels
from engine.sampler import first_max, masked, normalize, select_tokens
from engine.sampling import apply_repetition_penalty, draw, min_p_filter, top_k_filter, top_p_filter, uniform

NEG_INF = float("-inf")


def probs_to_logits(*probs: float) -> torch.Tensor:
    return torch.tensor([[math.log(p) for p in probs]])


def kept(logits: torch.Tensor) -> list[bool]:
    return (logits[0] != NEG_INF).tolist()


def test_top_k_keeps_the_k_largest():
    logits = probs_to_logits(0.1, 0.4, 0.2, 0.3)
    assert kept(top_k_filter(logits, torch.tensor([2]))) == [False, True, False, True]
    assert kept(top_k_filter(logits, torch.tensor([0]))) == [True] * 4  # 0 = off


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = probs_to_logits(0.1, 0.4, 0.2, 0.3)
    assert kept(top_p_filter(logits, torch.tensor([0.5]))) == [False, True, False, True]  # 0.4 + 0.3 >= 0.5
    assert kept(top_p_filter(logits, torch.tensor([0.4]))) == [False, True, False, False]
    assert kept(top_p_filter(logits, torch.tensor([0.01]))) == [False, True, False, False]  # the top one stays
    assert kept(top_p_filter(logits, torch.tensor([1.0]))) == [True] * 4


def test_min_p_drops_tokens_below_a_fraction_of_the_top():
    logits = probs_to_logits(0.1, 0.4, 0.2, 0.3)
    assert kept(min_p_filter(logits, torch.tensor([0.5]))) == [False, True, True, True]  # >= 0.2
    assert kept(min_p_filter(logits, torch.tensor([0.8]))) == [False, True, False, False]


def test_filters_are_per_row():
    logits = torch.cat([probs_to_logits(0.1, 0.4, 0.2, 0.3)] * 2)
    out = top_k_filter(logits, torch.tensor([1, 3]))
    assert (out != NEG_INF).sum(-1).tolist() == [1, 3]


def test_top_logprobs_are_the_most_likely_tokens_per_row():
    class Row:  # what select_tokens reads of a request
        def __init__(self, top_logprobs: int):
            self.params = SamplingParams(temperature=0, top_logprobs=top_logprobs)
            self.prompt_ids, self.output_ids, self.seed = [], [], 0

    logits = torch.cat([probs_to_logits(0.1, 0.4, 0.2, 0.3), probs_to_logits(0.5, 0.05, 0.25, 0.2)])
    first, second = select_tokens(logits, [Row(3), Row(0)])
    assert (first.token, second.token) == (1, 0)
    assert [t for t, _ in first.top] == [1, 3, 2]
    assert [lp for _, lp in first.top] == pytest.approx([math.log(0.4), math.log(0.3), math.log(0.2)], abs=1e-6)
    assert first.logprob == first.top[0][1]
    assert second.top == ()


def test_repetition_penalty_lowers_seen_tokens_of_either_sign():
    logits = torch.tensor([[2.0, -2.0, 1.0]])
    seen = torch.tensor([[True, True, False]])
    assert apply_repetition_penalty(logits, seen, torch.tensor([2.0])).tolist() == [[1.0, -4.0, 1.0]]


def test_greedy_is_argmax(make_engine):
    engine = make_engine()
    prompt = engine.tokenizer.encode("The quick brown")
    logits = engine.prompt_logits(prompt)[-1]
    (completion,) = engine.generate([prompt], SamplingParams(max_new_tokens=1, temperature=0))
    assert completion.output_ids == [int(logits.argmax())]
    assert completion.logprobs[0] == pytest.approx(logits.log_softmax(-1).max().item(), abs=1e-6)


def test_top_k_one_equals_greedy(make_engine):
    engine = make_engine()
    greedy = engine.generate(["Paris is"], SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True))
    top1 = engine.generate(["Paris is"], SamplingParams(max_new_tokens=10, temperature=1.5, top_k=1, ignore_eos=True))
    assert greedy[0].output_ids == top1[0].output_ids


def test_a_top_k_past_the_vocabulary_keeps_every_token(make_engine):
    engine = make_engine()
    sampled = [SamplingParams(max_new_tokens=10, temperature=1.5, seed=7, top_k=k, ignore_eos=True) for k in (0, 10**30)]
    off, huge = engine.generate(["Paris is", "Paris is"], sampled)  # 10**30 overflows int64: it must not reach torch
    assert off.output_ids == huge.output_ids and off.finish_reason == huge.finish_reason == "length"


def test_same_seed_same_tokens_alone_and_in_a_batch(make_engine):
    seeded = SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    alone = make_engine().generate(["Once upon a time"], seeded)[0].output_ids
    noisy = SamplingParams(max_new_tokens=16, temperature=1.3, ignore_eos=True)
    batch = make_engine().generate(["The quick", "Once upon a time", "Paris"], [noisy, seeded, noisy])
    assert batch[1].output_ids == alone
    other = make_engine().generate(["Once upon a time"], SamplingParams(
        max_new_tokens=16, temperature=1.0, top_p=0.95, seed=99, ignore_eos=True))[0].output_ids
    assert other != alone  # the seed does steer the draw


def test_unseeded_requests_report_the_seed_that_reproduces_them(make_engine):
    params = SamplingParams(max_new_tokens=12, temperature=1.0, ignore_eos=True)
    first = make_engine(seed=None).generate(["Once upon a time"], params)[0]
    again = make_engine(seed=None).generate(["Once upon a time"], SamplingParams(
        max_new_tokens=12, temperature=1.0, ignore_eos=True, seed=first.seed))[0]
    assert again.output_ids == first.output_ids


@pytest.mark.parametrize("field, value, message", [
    ("temperature", -0.5, "temperature must be >= 0"),
    ("top_p", 0.0, "top_p must be in (0, 1]"),
    ("top_p", 1.5, "top_p must be in (0, 1]"),
    ("top_k", -1, "top_k must be an integer >= 0"),
    ("min_p", 2.0, "min_p must be in [0, 1]"),
    ("repetition_penalty", 0.0, "repetition_penalty must be > 0"),
    ("max_new_tokens", 0, "max_new_tokens must be an integer >= 1"),
    ("seed", -3, "seed must be an integer in [0, 9223372036854775808)"),
    ("presence_penalty", 3.0, "presence_penalty must be in [-2, 2]"),
    ("top_logprobs", 21, "top_logprobs must be an integer in [0, 20]"),
])
def test_bad_parameters_are_rejected_with_a_clear_message(field, value, message):
    with pytest.raises(InvalidParameter) as error:
        SamplingParams(**{field: value})
    assert message in str(error.value)


def test_prompt_too_long_names_both_numbers(make_engine):
    engine = make_engine(max_seq_len=32)
    with pytest.raises(InvalidParameter, match=r"prompt \(\d+ tokens\) \+ max_new_tokens \(30\) = \d+ exceeds .* max_seq_len = 32"):
        engine.add_request("The quick brown fox jumps over the lazy dog", SamplingParams(max_new_tokens=30))
    with pytest.raises(InvalidParameter, match="empty"):
        engine.add_request("", SamplingParams())


class Sampled:  # what select_tokens reads of a request
    def __init__(self, **params):
        self.params = SamplingParams(**params)
        self.prompt_ids, self.output_ids, self.seed = [0, 1], [2], 0


@pytest.mark.parametrize("params", [
    dict(top_p=1e-300),  # 0 in float32
    dict(temperature=1e-40),  # inf logits in float32
    dict(temperature=1e-6, top_k=3),
    dict(repetition_penalty=5e-324),  # 0 in float32
    dict(repetition_penalty=1e300),
    dict(min_p=1.0, temperature=1e-30),
])
def test_every_accepted_extreme_value_samples_a_token(params):
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1)) * 10
    choices = select_tokens(logits, [Sampled(**params), Sampled(temperature=0.8), Sampled(temperature=0)])
    assert all(0 <= c.token < 50 and math.isfinite(c.logprob) for c in choices)
    if params.get("temperature", 1) < 1e-5 or "top_p" in params:  # greedy in effect: the most likely token
        assert choices[0].token == logits[0].argmax().item()


def test_temperature_below_epsilon_is_greedy():
    assert SamplingParams(temperature=1e-40).greedy and SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=1e-4).greedy


def kernel_draw(scores: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    return torch.ops.kvserve.draw(scores.contiguous(), uniform(seeds, steps))


# torch's form (any device) and kvserve's kernel (the CPU's, where it builds): the same rule.
DRAWS = [draw, pytest.param(kernel_draw, marks=pytest.mark.skipif(
    load_kernels() is not None, reason=f"kvserve's kernels are off here: {load_kernels()}"))]


@pytest.mark.parametrize("draw", DRAWS)
@pytest.mark.parametrize("filler", [0, 33])  # 0: 4 tokens, a tail alone; 33: whole runs of 8 before them, unlikely
def test_draw_follows_the_distribution_and_depends_only_on_seed_and_step(draw, filler):
    probs = torch.tensor([0.1, 0.4, 0.2, 0.3])
    scores = torch.cat([torch.full((4000, filler), -90.0), probs.log().expand(4000, -1)], dim=1)  # e^-90: no weight
    seeds, steps = torch.arange(4000), torch.full((4000,), 7)
    tokens = draw(scores, seeds, steps)
    frequencies = torch.bincount(tokens - filler, minlength=4) / 4000
    torch.testing.assert_close(frequencies, probs, atol=0.03, rtol=0)  # 4 sigma of a 4000-draw estimate
    assert draw(scores[:5], seeds[:5], steps[:5]).tolist() == tokens[:5].tolist()  # the batch does not matter
    assert draw(scores[:5], seeds[:5], steps[:5] + 1).tolist() != tokens[:5].tolist()
    filtered = scores.clone()
    filtered[:, filler + 1] = float("-inf")
    assert (draw(filtered, seeds, steps) != filler + 1).all()  # a filtered token is never drawn


def test_repetition_penalty_sees_token_zero_beside_padding():
    logits = torch.full((2, 5), 2.0)
    long_row, short_row = Sampled(repetition_penalty=2.0), Sampled(repetition_penalty=2.0)
    long_row.prompt_ids, long_row.output_ids = [1, 2, 3, 4], [1]
    short_row.prompt_ids, short_row.output_ids = [0], []  # padded to the long row's width: token 0 must stay seen
    from engine.sampler import _penalize

    penalized = _penalize(logits, [long_row, short_row])
    assert penalized[1].tolist() == [1.0, 2.0, 2.0, 2.0, 2.0]
    assert penalized[0].tolist() == [2.0, 1.0, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("draw", DRAWS)
@pytest.mark.parametrize("vocab, token", [(6, 2), (49152, 20000)])  # a tail alone; a grammar's forced token
def test_draw_never_lands_on_a_token_without_weight(draw, vocab, token):
    scores = torch.full((500, vocab), float("-inf"))
    scores[:, token] = 0.0  # the only token with weight, among filtered ones after it and before it
    scores[:, 0] = -100.0  # odds of e^-100: weighed 0, as float32 cannot tell them from nothing
    tokens = draw(scores, torch.arange(500), torch.zeros(500, dtype=torch.long))
    assert (tokens == token).all()


@pytest.mark.skipif(load_kernels() is not None, reason=f"kvserve's kernels are off here: {load_kernels()}")
def test_the_kernels_draw_is_torchs_but_at_a_rounding():
    """The same rule over a real vocabulary: the tokens differ only where a draw falls within roundings of a
    boundary between two tokens (exp and the order of sums differ); a row's token is its own, whatever the batch."""
    scores = torch.randn(400, 49152, generator=torch.Generator().manual_seed(3)) * 4
    seeds, steps = torch.arange(400), torch.full((400,), 11)
    got, want = kernel_draw(scores, seeds, steps), draw(scores, seeds, steps)
    assert (got == want).sum() >= 398
    assert torch.equal(kernel_draw(scores[7:9], seeds[7:9], steps[7:9]), got[7:9])


@pytest.mark.skipif(load_kernels() is not None, reason=f"kvserve's kernels are off here: {load_kernels()}")
@pytest.mark.parametrize("vocab", [1, 13, 64, 200, 49152])  # 13: a tail past the last 8; 200: past whole runs of vectors
def test_the_kernels_greedy_token_and_log_norm_are_torchs(vocab):
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(vocab)) * 5
    if vocab > 8:
        logits[0, vocab // 2] = logits[0, vocab - 3] = logits[0].max() + 1  # a tie: the first index, as argmax
        logits[1, 3] = logits[1, vocab - 1] = float("-inf")  # a token the model rules out: any other logit
    best, log_norm = torch.ops.kvserve.log_norm(logits)
    assert torch.equal(best, logits.argmax(dim=-1)) and torch.equal(torch.ops.kvserve.first_max(logits), best)
    exact = logits.double().logsumexp(dim=-1)
    assert ((log_norm.double() - exact).abs() <= 1e-6 * exact.abs().clamp(min=1)).all()
    for row in range(len(logits)):  # a row's bits are its own, whatever rows come with it
        alone = torch.ops.kvserve.log_norm(logits[row:row + 1].contiguous())
        assert alone[0].item() == best[row].item() and alone[1].item() == log_norm[row].item()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_row_of_non_finite_logits_is_refused(bad):
    for logits in (torch.randn(3, 100), torch.full((3, 100), float("-inf"))):
        logits[1, 50] = bad
        with pytest.raises(FloatingPointError, match="non-finite"):
            normalize(logits)


@pytest.mark.skipif(load_kernels() is not None, reason=f"kvserve's kernels are off here: {load_kernels()}")
@pytest.mark.parametrize("vocab", [5, 37, 49152])  # 5 and 37: tails past the last 8 and the last whole word
def test_the_kernels_grammar_mask_is_the_bitmask_unpacked(vocab):
    """llguidance's words, bit j of word w for token 32·w + j (a spare word past the vocabulary, as it may send),
    against the bits unpacked one by one; then the greedy token is the best allowed one."""
    words = torch.randint(-2**31, 2**31 - 1, (3, vocab // 32 + 2), dtype=torch.int32,
                          generator=torch.Generator().manual_seed(vocab))
    words[2] = 0
    words[2, 0] = 1 << 3  # one token allowed: a grammar's forced token
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(vocab + 1))
    allowed = torch.tensor([[(int(words[r, i // 32]) >> (i % 32)) & 1 for i in range(vocab)] for r in range(3)]).bool()
    want = torch.where(allowed, logits, torch.tensor(NEG_INF))
    assert torch.equal(masked(logits, words), want)
    assert torch.equal(first_max(masked(logits, words)), want.argmax(dim=-1)) and first_max(want)[2] == 3

    class Greedy:  # what select_tokens reads of a request
        params, prompt_ids, output_ids, seed = SamplingParams(temperature=0), [], [], 0

    picks = select_tokens(logits, [Greedy()] * 3, words)
    assert [p.token for p in picks] == want.argmax(dim=-1).tolist()
    assert [p.logprob for p in picks] == pytest.approx((logits.log_softmax(-1)[range(3), want.argmax(-1)]).tolist())


def test_top_p_and_top_k_keep_the_most_likely_tokens_of_wide_and_narrow_rows():
    """Rows whose nucleus is a few tokens, and wider than the first partial selection (512): each keeps exactly the
    m most likely tokens, m the fewest whose probability reaches p; a row with p = 1 keeps all; top_k its k."""
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 3000, generator=generator) * torch.tensor([[8.0], [0.3], [2.0], [1.0]])
    p = torch.tensor([0.9, 0.95, 0.5, 1.0])
    kept = top_p_filter(logits, p) != NEG_INF
    order = logits.double().softmax(dim=-1).sort(dim=-1, descending=True)
    for row in range(3):
        m = int(kept[row].sum())
        assert set(order.indices[row, :m].tolist()) == set(kept[row].nonzero()[:, 0].tolist())
        mass = order.values[row].cumsum(dim=0)
        assert (m == 1 or mass[m - 2] < p[row] + 1e-5) and mass[m - 1] >= p[row] - 1e-5
    assert kept[1].sum() > 512 and kept[0].sum() < 512 and kept[3].all()
    k = torch.tensor([3, 0, 700, 1])
    top_k = top_k_filter(logits, k) != NEG_INF
    assert top_k.sum(dim=-1).tolist() == [3, 3000, 700, 1]
    assert torch.equal(top_k[2], logits[2] >= logits[2].topk(700).values[-1])


def test_penalties_on_the_seen_tokens_alone_equal_them_over_the_whole_vocabulary():
    """_penalize computes on each row's seen tokens and writes them back: the same bits as both penalties applied
    to every logit (a token unseen, or seen only in the prompt, meets a count of 0), rows with repeated tokens,
    token 0 and a row that saw nothing among them."""
    from engine.sampler import _penalize
    from engine.sampling import apply_additive_penalties

    generator = torch.Generator().manual_seed(9)
    logits = torch.randn(4, 300, generator=generator) * 3
    logits[:, 0] = torch.tensor([2.0, -2.0, 0.0, 1.0])
    rows = [Sampled(repetition_penalty=r, presence_penalty=p, frequency_penalty=f)
            for r, p, f in ((1.3, 0.5, 0.2), (0.7, -0.4, 0.0), (1.0, 0.0, -0.3), (2.0, 1.0, 1.0))]
    rows[0].prompt_ids, rows[0].output_ids = [0, 5, 5, 299], [7, 7, 7, 0]
    rows[1].prompt_ids, rows[1].output_ids = [3], [0, 1, 2, 3, 4, 5, 6, 7, 8]
    rows[2].prompt_ids, rows[2].output_ids = [], []
    rows[3].prompt_ids, rows[3].output_ids = list(range(100)), [250]
    counts = torch.zeros(4, 300)
    seen = torch.zeros(4, 300, dtype=torch.bool)
    for i, row in enumerate(rows):
        for token in row.output_ids:
            counts[i, token] += 1
        seen[i, row.prompt_ids + row.output_ids] = True
    want = apply_repetition_penalty(logits, seen, torch.tensor([1.3, 0.7, 1.0, 2.0]))
    want = apply_additive_penalties(want, counts, torch.tensor([0.5, -0.4, 0.0, 1.0]),
                                    torch.tensor([0.2, 0.0, -0.3, 1.0]))
    assert torch.equal(_penalize(logits, rows), want)
