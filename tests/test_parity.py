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


def test_batched_decode_logprobs_match_full_forward(model_dir, make_engine, hf_model):
    """Every decode step of a mixed-length batch scores its token as a full forward over the prefix does."""
    path = model_dir("gqa")
    engine, reference = make_engine(path), hf_model(path)
    completions = engine.generate(PROMPTS, SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))
    for completion in completions:
        full = completion.prompt_ids + completion.output_ids
        with torch.no_grad():
            logprobs = reference(torch.tensor([full])).logits[0].log_softmax(-1)
        n = len(completion.prompt_ids)
        expected = [logprobs[n - 1 + i, t].item() for i, t in enumerate(completion.output_ids)]
        assert completion.logprobs == pytest.approx(expected, abs=1e-4)
