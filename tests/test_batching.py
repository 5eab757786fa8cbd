"""Prefill + decode against one long forward, and continuous batching that does not change tokens."""

from __future__ import annotations

import pytest
import torch

from engine import FinishReason, RequestFailed, SamplingParams

GREEDY = SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True)
PROMPTS = ["The quick brown fox jumps over", "Paris", "def add(a, b):\n    return a + b", "Once upon a time there"]


def test_prefill_then_decode_equals_one_forward(make_engine):
    engine = make_engine()
    request = engine.add_request("The quick brown fox", GREEDY)
    events = [event for _ in range(6) for event in engine.step()]
    full = request.prompt_ids + request.output_ids  # n prompt tokens + 6 generated (5 of them decoded)
    logprobs = make_engine().prompt_logits(full).log_softmax(-1)
    n = len(request.prompt_ids)
    expected = [logprobs[n - 1 + i, event.token_id].item() for i, event in enumerate(events)]
    assert [event.logprob for event in events] == pytest.approx(expected, abs=1e-5)
    assert [event.token_id for event in events] == logprobs[n - 1:].argmax(-1).tolist()[:6]


def test_prefill_in_chunks_equals_prefill_at_once(make_engine):
    prompt = " ".join(["The quick brown fox jumps over the lazy dog."] * 4)
    whole = make_engine().prompt_logits(prompt)
    chunked = make_engine(prefill_chunk_size=7).prompt_logits(prompt)
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=1e-5)


def test_mixed_lengths_in_one_batch_equal_each_alone(make_engine):
    together = make_engine(max_batch_size=4).generate(PROMPTS, GREEDY)
    alone = [make_engine(max_batch_size=1).generate([p], GREEDY)[0] for p in PROMPTS]
    assert [c.output_ids for c in together] == [c.output_ids for c in alone]


def test_prompts_admitted_together_get_the_bits_each_gets_alone(tmp_path):
    """A Q4_0 GGUF on kvserve's kernels (each row's products its own): prompts of different lengths admitted in one
    step get, token by token, the same logprob bits as each prompt alone. Bits, not tokens: a prompt whose last
    bits moved with the prompts beside it would flip a near tie some time, and then what a request gets would
    depend on what else arrived; speculative decoding, which changes when requests end and others are admitted,
    would change it. (A prefill pass shared by prompts of different lengths did move them.)"""
    from gguf import GGMLQuantizationType

    from engine import EngineConfig
    from tests.tiny import write_gguf_model, write_model
    from weights.gguf_file import import_gguf
    from weights.loading import load_engine

    src = write_model(tmp_path / "src", kind="qwen3")
    write_gguf_model(src, tmp_path / "q4.gguf", "qwen3", matrix_type=GGMLQuantizationType.Q4_0)
    imported = import_gguf(tmp_path / "q4.gguf", tmp_path / "imported", progress=False)

    def logprobs(slots: int, prompts: list[str]) -> list[list[tuple[int, float]]]:
        engine = load_engine(imported, EngineConfig(device="cpu", max_batch_size=slots, max_seq_len=128, seed=0))
        requests = [engine.add_request(p, GREEDY) for p in prompts]
        seen = {r.request_id: [] for r in requests}
        while engine.has_work:
            for event in engine.step():
                seen[event.request_id].append((event.token_id, event.logprob))
        return [seen[r.request_id] for r in requests]

    assert logprobs(4, PROMPTS) == [logprobs(1, [p])[0] for p in PROMPTS]


def test_request_joining_mid_way_changes_nothing(make_engine):
    engine = make_engine(max_batch_size=4)
    first = engine.add_request(PROMPTS[0], GREEDY)
    for _ in range(7):
        engine.step()
    second = engine.add_request(PROMPTS[1], GREEDY)
    while not (first.finished and second.finished):
        engine.step()
    alone = make_engine().generate(PROMPTS[:2], GREEDY)
    assert first.output_ids == alone[0].output_ids
    assert second.output_ids == alone[1].output_ids


def test_waiting_requests_are_served_first_come_first_served(make_engine):
    engine = make_engine(max_batch_size=1)
    requests = [engine.add_request(p, SamplingParams(max_new_tokens=2, temperature=0, ignore_eos=True)) for p in PROMPTS]
    started = []
    while engine.has_work:
        for event in engine.step():
            if event.index == 0:
                started.append(event.request_id)
    assert started == [r.request_id for r in requests]


def test_decode_reads_only_filled_positions(make_engine):
    """With short sequences a decode step attends over max(length)+1 keys, not the configured T."""
    from engine.batch import DecodeBatch

    batch = DecodeBatch([0, 2], [5, 9], torch.device("cpu"))
    assert batch.kv_len == 10
    assert batch.mask.shape == (2, 1, 1, 10)
    assert batch.mask[0, 0, 0].tolist() == [True] * 6 + [False] * 4


def test_finish_reasons(make_engine):
    engine = make_engine()
    tokenizer = engine.tokenizer
    eos = tokenizer.eos_token_ids[0]
    (length,) = engine.generate(["Paris"], SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True))
    assert length.finish_reason == "length" and len(length.output_ids) == 3
    first = length.output_ids[0]
    (stopped,) = engine.generate(["Paris"], SamplingParams(max_new_tokens=3, temperature=0, stop_token_ids=(first,)))
    assert stopped.finish_reason == "eos" and stopped.output_ids == [first]
    text = length.text
    if text.strip():
        stop = text.strip()[0]
        (by_string,) = engine.generate(["Paris"], SamplingParams(max_new_tokens=3, temperature=0, stop=(stop,)))
        assert by_string.finish_reason == "stop" and stop in by_string.text
    assert eos in tokenizer.eos_token_ids


def test_stop_string_spanning_tokens_ends_the_request_where_it_first_appears(make_engine):
    engine = make_engine()
    params = dict(max_new_tokens=30, temperature=0, ignore_eos=True)
    (free,) = engine.generate(["The quick brown"], SamplingParams(**params))
    text = free.text
    stop = next((text[i:i + 4] for i in range(3, len(text) - 4) if text[i:i + 4].strip() == text[i:i + 4]), None)
    if stop is None:
        pytest.skip("this random model produced no usable four-character stretch")
    (stopped,) = engine.generate(["The quick brown"], SamplingParams(stop=(stop,), **params))
    assert stopped.finish_reason == "stop"
    assert stopped.output_ids == free.output_ids[: len(stopped.output_ids)]
    # It stopped at the first token that completed the stop string, not before and not after.
    assert stop in engine.tokenizer.decode(stopped.output_ids)
    assert stop not in engine.tokenizer.decode(stopped.output_ids[:-1])


def test_batched_prefill_into_reused_slots_ignores_what_they_held(make_engine):
    engine = make_engine(max_batch_size=2)
    long_prompt = " ".join(["The quick brown fox jumps over the lazy dog."] * 6)
    engine.generate([long_prompt, long_prompt], SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True))
    # Both slots now hold stale keys far past the short prompts' lengths.
    reused = engine.generate(PROMPTS[:2], GREEDY)
    fresh = [make_engine(max_batch_size=1).generate([p], GREEDY)[0] for p in PROMPTS[:2]]
    assert [c.output_ids for c in reused] == [c.output_ids for c in fresh]
    for got, expected in zip(reused, fresh):
        assert got.logprobs == pytest.approx(expected.logprobs, abs=1e-5)


def test_a_request_that_fails_ends_alone(make_engine):
    """A poisoned embedding row (NaN) makes the prompt that uses it fail; the batch goes on."""
    engine = make_engine(max_batch_size=4)
    poison = engine.tokenizer.encode("Berlin")[0]
    engine.model.embed_tokens.weight[poison] = float("nan")
    healthy = [engine.add_request(p, GREEDY) for p in PROMPTS[:3]]
    for _ in range(3):
        engine.step()
    bad = engine.add_request([poison, poison], SamplingParams(max_new_tokens=20, temperature=1.0))
    failures = [e for e in engine.step() if isinstance(e, RequestFailed)]
    assert [f.request_id for f in failures] == [bad.request_id]
    assert "non-finite logits" in failures[0].message
    assert bad.finish_reason is FinishReason.ERROR and bad.request_id not in engine.requests
    while engine.has_work:
        assert not any(isinstance(e, RequestFailed) for e in engine.step())
    alone = make_engine().generate(PROMPTS[:3], GREEDY)
    assert [r.output_ids for r in healthy] == [c.output_ids for c in alone]


def test_a_long_prompt_is_written_one_chunk_per_step_while_running_streams_go_on(make_engine):
    engine = make_engine(max_batch_size=2, max_seq_len=256, prefill_chunk_size=16)
    params = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
    running = engine.add_request([5, 6, 7], params)
    engine.step()  # its prefill and first token
    arriving = engine.add_request([(3 * i) % 300 + 5 for i in range(100)], params)
    steps = []
    while not arriving.output_ids:
        events = engine.step()
        steps.append(({e.request_id for e in events}, arriving.prefilled))
    # 100 prompt tokens in chunks of 16: 7 steps, each also one decode step for the running stream.
    assert [prefilled for _, prefilled in steps] == [16, 32, 48, 64, 80, 96, 100]
    assert all(running.request_id in ids for ids, _ in steps)
    assert [arriving.request_id in ids for ids, _ in steps] == [False] * 6 + [True]
    assert len(running.output_ids) == 1 + len(steps)


def test_short_prompts_join_a_pass_while_it_stays_within_one_chunk(make_engine):
    engine = make_engine(max_batch_size=4, prefill_chunk_size=16)
    params = SamplingParams(max_new_tokens=2, temperature=0, ignore_eos=True)
    first, second, third = (engine.add_request(list(range(start, start + n)), params)
                            for start, n in ((5, 6), (50, 5), (100, 7)))  # no prefix in common
    engine.step()  # 2 rows x 6 padded tokens fit in 16; a third row (3 x 7 = 21) waits for the next step
    assert (len(first.output_ids), len(second.output_ids), len(third.output_ids)) == (1, 1, 0)
    engine.step()
    assert (len(first.output_ids), len(second.output_ids), len(third.output_ids)) == (2, 2, 1)
