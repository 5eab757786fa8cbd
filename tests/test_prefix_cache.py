"""Prefix caching: a free slot keeps its tokens' K/V, and a request sharing their prefix starts after it.

Greedy tokens with reuse must equal transformers' on the full prompt (float32, tiny GQA model).
"""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams

GREEDY = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
PROMPT = [(7 * i) % 300 + 5 for i in range(40)]


@pytest.fixture
def reference(tiny_dir, hf_model):
    model = hf_model(tiny_dir)

    def greedy(ids: list[int], n: int = GREEDY.max_new_tokens) -> list[int]:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return out[0, len(ids):].tolist()

    return greedy


def test_the_same_prompt_twice_reuses_all_but_its_last_token(make_engine, reference):
    engine = make_engine(max_batch_size=2)
    (first,) = engine.generate([PROMPT], GREEDY)
    (second,) = engine.generate([PROMPT], GREEDY)
    assert (first.reused_prompt_tokens, second.reused_prompt_tokens) == (0, len(PROMPT) - 1)
    assert second.output_ids == first.output_ids == reference(PROMPT)


def test_a_next_turn_reuses_the_previous_prompt_and_answer(make_engine, reference):
    engine = make_engine(max_batch_size=2)
    (turn1,) = engine.generate([PROMPT], GREEDY)
    history = PROMPT + turn1.output_ids + [11, 12, 13]
    (turn2,) = engine.generate([history], GREEDY)
    # Every token but the last answer token was fed through the model, so the slot holds all of them.
    assert turn2.reused_prompt_tokens == len(PROMPT) + len(turn1.output_ids) - 1
    assert turn2.output_ids == reference(history)


def test_a_prompt_diverging_mid_prefix_reuses_only_the_shared_part(make_engine, reference):
    engine = make_engine(max_batch_size=1)
    engine.generate([PROMPT], GREEDY)
    other = PROMPT[:17] + [3, 4, 5, 6] + PROMPT[21:]
    (completion,) = engine.generate([other], GREEDY)
    assert completion.reused_prompt_tokens == 17
    assert completion.output_ids == reference(other)


@pytest.mark.parametrize("last", [9, 250])
def test_prompts_differing_in_their_last_token_only(make_engine, reference, last):
    engine = make_engine(max_batch_size=1)
    engine.generate([PROMPT[:-1] + [300]], GREEDY)
    prompt = PROMPT[:-1] + [last]
    (completion,) = engine.generate([prompt], GREEDY)
    assert completion.reused_prompt_tokens == len(PROMPT) - 1
    assert completion.output_ids == reference(prompt)


def test_a_shorter_prompt_inside_a_kept_one_never_reads_past_its_end(make_engine, reference):
    engine = make_engine(max_batch_size=1)
    engine.generate([PROMPT], GREEDY)
    prompt = PROMPT[:12]
    (completion,) = engine.generate([prompt], GREEDY)
    assert completion.reused_prompt_tokens == 11
    assert completion.output_ids == reference(prompt)


def test_the_slot_with_the_longest_shared_prefix_wins(make_engine):
    engine = make_engine(max_batch_size=3)
    a, b = PROMPT, [9, 8, 7] + PROMPT[3:]
    for prompt in (a, b):
        engine.generate([prompt], GREEDY)
    kept = {tuple(engine.scheduler.kept[slot][:3]): slot for slot in engine.scheduler.free_slots}
    request = engine.add_request(b[:30] + [1, 2], GREEDY)
    engine.step()
    assert request.slot == kept[(9, 8, 7)] and request.reused_tokens == 30
    unrelated = engine.add_request([1] * 10, GREEDY)
    engine.step()
    assert unrelated.reused_tokens == 0
    assert engine.scheduler.kept[unrelated.slot] == []  # it took the unused slot, the least recently used


def test_long_prompts_reuse_across_chunks(make_engine, reference):
    engine = make_engine(max_batch_size=1, prefill_chunk_size=16)
    engine.generate([PROMPT], GREEDY)
    longer = PROMPT + PROMPT[::-1]
    (completion,) = engine.generate([longer], GREEDY)
    assert completion.reused_prompt_tokens == len(PROMPT)
    assert completion.output_ids == reference(longer)


def test_off_reuses_nothing(make_engine):
    engine = make_engine(max_batch_size=1, prefix_caching=False)
    engine.generate([PROMPT], GREEDY)
    (completion,) = engine.generate([PROMPT], GREEDY)
    assert completion.reused_prompt_tokens == 0 and engine.cache_kept_bytes == 0


def test_prompt_logprobs_score_every_position_even_when_a_prefix_is_kept(make_engine):
    engine = make_engine(max_batch_size=1)
    engine.generate([PROMPT], GREEDY)
    params = SamplingParams(max_new_tokens=1, temperature=0, prompt_logprobs=True)
    (completion,) = engine.generate([PROMPT], params)
    assert completion.reused_prompt_tokens == 0 and len(completion.prompt_logprobs) == len(PROMPT) - 1


def test_scratch_use_of_a_slot_forgets_what_it_kept(make_engine, reference):
    engine = make_engine(max_batch_size=1)
    engine.generate([PROMPT], GREEDY)
    assert engine.cache_kept_bytes == engine.cache.used_bytes(len(PROMPT) + GREEDY.max_new_tokens - 1)
    engine.prompt_logits(PROMPT[::-1])  # writes its own K/V into the free slot
    (completion,) = engine.generate([PROMPT], GREEDY)
    assert completion.reused_prompt_tokens == 0
    assert completion.output_ids == reference(PROMPT)


def test_a_prefix_held_by_a_running_request_is_copied_from_its_slot(make_engine, reference):
    engine = make_engine(max_batch_size=3, prefill_chunk_size=16)
    system = PROMPT[:32]
    first = engine.add_request(system + [1, 2, 3, 4], SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True))
    engine.step()
    engine.step()
    engine.step()  # 36 prompt tokens in chunks of 16: written, and decoding
    assert first.output_ids and first.slot is not None
    second_prompt = system + [9, 8, 7]
    second = engine.add_request(second_prompt, GREEDY)
    engine.step()
    assert (second.copy_from, second.reused_tokens) == (first.slot, 32)
    while not (first.finished and second.finished):
        engine.step()
    assert second.output_ids == reference(second_prompt)
    assert first.output_ids == reference(system + [1, 2, 3, 4], 30)


def test_a_request_waits_for_a_shared_prefix_being_written_rather_than_compute_it(make_engine, reference):
    engine = make_engine(max_batch_size=3, prefill_chunk_size=16)
    system = PROMPT[:40]
    prompts = [system + [1, 2, 3, 4, 5, 6, 7, 8], system + [9, 8, 7]]
    first, second = (engine.add_request(p, GREEDY) for p in prompts)
    admitted_at = None
    for step in range(1, 5):
        engine.step()
        if admitted_at is None and second.slot is not None:
            admitted_at = step
    # first writes 16, 32, 48 tokens in steps 1-3; second is admitted once the 40 shared ones are written
    assert admitted_at == 4 and (second.copy_from, second.reused_tokens) == (first.slot, 40)
    while not (first.finished and second.finished):
        engine.step()
    assert [first.output_ids, second.output_ids] == [reference(p) for p in prompts]


def test_requests_with_one_short_prompt_compute_it_once(make_engine, reference):
    engine = make_engine(max_batch_size=3)
    prompt = PROMPT[:10]
    first, *siblings = (engine.add_request(prompt, GREEDY) for _ in range(3))
    engine.step()  # the first writes the prompt; the others wait for it rather than compute it too
    assert first.prefilled == len(prompt) and all(s.slot is None for s in siblings)
    engine.step()
    assert [(s.copy_from, s.reused_tokens) for s in siblings] == [(first.slot, len(prompt) - 1)] * 2
    while not all(r.finished for r in (first, *siblings)):
        engine.step()
    assert [r.output_ids for r in (first, *siblings)] == [reference(prompt)] * 3
