"""Our logits and greedy tokens against Hugging Face transformers on the same weights (the oracle)."""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from tests.conftest import VARIANTS

PROMPTS = ["The quick brown fox", "Paris is the capital of", "def add(a, b):\n    return a + b\n\nprint(add(2, 3))"]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_prompt_logits_match_transformers(variant, model_dir, make_engine, hf_model):
    path = model_dir(variant)
    engine, reference = make_engine(path), hf_model(path)
    for prompt in PROMPTS:
        ids = engine.tokenizer.encode(prompt)
        ours = engine.prompt_logits(ids)
        with torch.no_grad():
            theirs = reference(torch.tensor([ids])).logits[0]
        assert ours.shape == theirs.shape
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_generation_matches_transformers(variant, model_dir, make_engine, hf_model):
    path = model_dir(variant)
    engine, reference = make_engine(path), hf_model(path)
    completions = engine.generate(PROMPTS, SamplingParams(max_new_tokens=32, temperature=0))
    for prompt, completion in zip(PROMPTS, completions):
        ids = engine.tokenizer.encode(prompt)
        with torch.no_grad():
            expected = reference.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0, len(ids):]
        assert completion.output_ids == expected.tolist()


@pytest.mark.parametrize("variant", ["gqa", "qwen3", "gemma3"])
def test_batched_decode_logprobs_match_full_forward(variant, model_dir, make_engine, hf_model):
    """Every decode step of a mixed-length batch scores its token as a full forward over the prefix does (Gemma 3:
    past its window of 4 keys, its sliding layers' rings wrapping)."""
    path = model_dir(variant)
    engine, reference = make_engine(path), hf_model(path)
    wanted = [0, 3, 5]  # alternatives per token, different for each row of the batch
    completions = engine.generate(PROMPTS, [SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True,
                                                           top_logprobs=n) for n in wanted])
    for completion, n in zip(completions, wanted):
        full = completion.prompt_ids + completion.output_ids
        with torch.no_grad():
            logprobs = reference(torch.tensor([full])).logits[0].log_softmax(-1)
        start = len(completion.prompt_ids) - 1  # the position whose output predicts the first new token
        expected = [logprobs[start + i, t].item() for i, t in enumerate(completion.output_ids)]
        assert completion.logprobs == pytest.approx(expected, abs=1e-4)
        for i, top in enumerate(completion.top_logprobs):
            row = logprobs[start + i]
            assert len(top) == n
            assert [lp for _, lp in top] == pytest.approx([row[t].item() for t, _ in top], abs=1e-4)
            if n:  # a valid top n (robust to near-ties in order): nothing left out beats the last one reported
                assert top[0][0] == completion.output_ids[i]  # greedy picks the most likely
                left_out = row.clone()
                left_out[[t for t, _ in top]] = float("-inf")
                assert left_out.max().item() <= top[-1][1] + 1e-4


@pytest.mark.parametrize("chunk", [512, 4], ids=["prompts batched", "prompts in chunks of 4"])
def test_prompt_logprobs_match_transformers(chunk, model_dir, make_engine, hf_model):
    """Each prompt token scored by its prefix, with alternatives, as a full forward of transformers scores it."""
    path = model_dir("gqa")
    engine, reference = make_engine(path, prefill_chunk_size=chunk), hf_model(path)
    params = [SamplingParams(max_new_tokens=2, temperature=0, prompt_logprobs=True, top_logprobs=n) for n in (0, 2, 4)]
    for completion, n in zip(engine.generate(PROMPTS, params), (0, 2, 4)):
        ids = completion.prompt_ids
        with torch.no_grad():
            logprobs = reference(torch.tensor([ids])).logits[0].log_softmax(-1)  # row i scores token i + 1
        scored = completion.prompt_logprobs
        assert [c.token for c in scored] == ids[1:]
        assert [c.logprob for c in scored] == pytest.approx([logprobs[i, t].item() for i, t in enumerate(ids[1:])],
                                                            abs=1e-4)
        for i, choice in enumerate(scored):
            assert len(choice.top) == n
            assert [lp for _, lp in choice.top] == pytest.approx([logprobs[i, t].item() for t, _ in choice.top], abs=1e-4)
            if n:
                assert choice.top[0][1] == pytest.approx(logprobs[i].max().item(), abs=1e-4)
    plain = engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2, temperature=0))[0]
    assert plain.prompt_logprobs is None
