"""Qwen3 and Gemma 3: tiny random models written by transformers' own classes, served as their folders and as GGUF
files in llama.cpp's layout; the oracle is transformers on the same weights (float32).

The Gemma 3 model has a window of 4 keys, and every prompt and answer here runs well past it.
"""

from __future__ import annotations

import httpx
import pytest
import torch
from torch._dynamo.utils import counters

from engine import SamplingParams
from tests.server_harness import serve
from tests.tiny import write_gguf_model
from weights.gguf_file import import_gguf

PROMPTS = ["The quick brown fox jumps over the lazy dog", "Paris",
           "def add(a, b):\n    return a + b\n\nprint(add(2, 3))", "Once upon a time there was"]
FAMILIES = ["qwen3", "gemma3"]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_equals_alone_and_transformers(family, model_dir, make_engine, hf_model):
    path = model_dir(family)
    engine, reference = make_engine(path), hf_model(path)
    lengths = [30, 12, 25, 18]
    together = engine.generate(PROMPTS, [greedy(n) for n in lengths])
    for prompt, n, completion in zip(PROMPTS, lengths, together):
        (alone,) = engine.generate([prompt], greedy(n))
        assert completion.output_ids == alone.output_ids == hf_greedy(reference, completion.prompt_ids, n)


@pytest.mark.parametrize("chunk", [3, 5, 512])
def test_gemma3_prefill_in_chunks_shorter_and_longer_than_the_window(chunk, model_dir, make_engine, hf_model):
    path = model_dir("gemma3")
    engine = make_engine(path, prefill_chunk_size=chunk)
    ids = engine.tokenizer.encode(PROMPTS[2])
    assert len(ids) > 4 * chunk or chunk == 512
    with torch.no_grad():
        theirs = hf_model(path)(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(engine.prompt_logits(ids), theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family, full_windows", [("qwen3", False), ("gemma3", False), ("gemma3", True)])
def test_prefix_reuse_equals_no_reuse(family, full_windows, model_dir, make_engine):
    """Gemma 3's sliding layers keep only their window (4 keys): a slot that wrote more is reusable only whole (the
    next turn of its conversation); with full_windows they keep every position and any prefix is reusable."""
    path = model_dir(family)
    cached = make_engine(path, max_batch_size=2, full_windows=full_windows)
    plain = make_engine(path, max_batch_size=2, prefix_caching=False)
    prompt = cached.tokenizer.encode(PROMPTS[0] + " " + PROMPTS[3])
    (turn1,) = cached.generate([prompt], greedy(10))
    (again,) = cached.generate([prompt], greedy(10))
    history = prompt + turn1.output_ids + prompt[:6]
    (turn2,) = cached.generate([history], greedy(10))
    ring = cached.cache.ring_capacity is not None
    assert ring == (family == "gemma3" and not full_windows)
    assert again.reused_prompt_tokens == (0 if ring else len(prompt) - 1)  # a ring lost the prompt's first keys
    assert turn2.reused_prompt_tokens == len(prompt) + 9  # all that turn 1 wrote (not its last token)
    assert again.output_ids == turn1.output_ids == plain.generate([prompt], greedy(10))[0].output_ids
    assert turn2.output_ids == plain.generate([history], greedy(10))[0].output_ids


@pytest.mark.parametrize("family, kernels", [("qwen3", True), ("gemma3", True), ("gemma3", False)])
def test_compiled_step_equals_eager(family, kernels, model_dir, make_engine, monkeypatch):
    """Compiled decode with kvserve's attention kernel, and (Gemma 3's rings) with the broadcast form instead."""
    path = model_dir(family)
    if not kernels:
        monkeypatch.setattr("engine.executor.kernels_run_on", lambda device: False)
    compiled, eager = make_engine(path, compile="on", max_seq_len=64), make_engine(path, max_seq_len=64)
    assert compiled.executor.reads_cache == kernels
    assert compiled.compile()
    lengths = [40, 12, 25, 33]
    want = [c.output_ids for c in eager.generate(PROMPTS, [greedy(n) for n in lengths])]
    frames = counters["frames"]["total"]
    assert [c.output_ids for c in compiled.generate(PROMPTS, [greedy(n) for n in lengths])] == want
    assert counters["frames"]["total"] == frames  # every step on the graphs compiled up front, past the rings' ends


@pytest.mark.parametrize("family", FAMILIES)
def test_through_the_real_server_equals_transformers(family, model_dir, hf_model):
    path = model_dir(family)
    reference = hf_model(path)
    with serve(path, max_seq_len=256) as server:
        for prompt in PROMPTS[:2]:
            body = {"inputs": prompt, "parameters": {"max_new_tokens": 20, "decoder_input_details": True,
                                                     "details": True}}
            reply = httpx.post(f"{server.url}/generate", json=body, timeout=60).json()
            ids = [t["id"] for t in reply["details"]["prefill"]]
            tokens = [t["id"] for t in reply["details"]["tokens"]]
            with torch.no_grad():
                out = reference.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False)
            assert tokens == out[0, len(ids):].tolist()[: len(tokens)] and tokens


# ---- the same models as GGUF files ------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_a_gguf_serves_the_same_tokens_as_its_folder(family, model_dir, make_engine, tmp_path):
    path = model_dir("gemma3_gguf" if family == "gemma3" else family)
    write_gguf_model(path, tmp_path / "model.gguf", family)
    imported = import_gguf(tmp_path / "model.gguf", tmp_path / "imported", progress=False)
    from weights.checkpoint import load_config

    assert load_config(imported) == load_config(path)
    want = [c.output_ids for c in make_engine(path).generate(PROMPTS, greedy(24))]
    assert [c.output_ids for c in make_engine(imported).generate(PROMPTS, greedy(24))] == want


def test_a_vision_language_gemma3_serves_its_text_model(tmp_path, make_engine):
    """Gemma 3 4B and larger are Gemma3ForConditionalGeneration: kvserve serves the text model inside (the vision
    tower's tensors are left unread), as transformers computes it on text alone."""
    import transformers

    from tests.tiny import train_tokenizer, write_tokenizer

    write_tokenizer(tmp_path, train_tokenizer())
    text = dict(vocab_size=400, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, sliding_window=4, max_position_embeddings=256,
                layer_types=["sliding_attention", "full_attention"], bos_token_id=1, eos_token_id=2, pad_token_id=0)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=8)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.normal_(0.0, 0.5)
    model.save_pretrained(tmp_path, safe_serialization=True)
    engine = make_engine(tmp_path)
    assert engine.model.config.model_type == "gemma3_text"
    ids = engine.tokenizer.encode(PROMPTS[2])
    with torch.no_grad():
        theirs = model(input_ids=torch.tensor([ids])).logits[0]
    torch.testing.assert_close(engine.prompt_logits(ids), theirs, atol=1e-4, rtol=1e-4)
