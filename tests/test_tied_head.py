"""A quantized LM head tied to the embedding: codes for few rows, the dense embedding for many, one weight."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from engine import Engine, EngineConfig
from engine.cpu_linear import CpuLinear
from engine.model import build_model
from engine.quantization import Int8Linear
from engine.tied_head import TiedHead, dense_from, row_counts
from engine.tokenizer import Tokenizer
from weights.checkpoint import load_checkpoint


@pytest.mark.parametrize("timings,expected", [
    ({1: (1, 3), 2: (2, 3), 4: (4, 3), 8: (8, 4)}, 4),  # codes cost grows with the rows, dense barely
    ({1: (1, 3), 2: (3, 2), 4: (2, 3), 8: (8, 4)}, 8),  # dense must win at every larger count, not once
    ({1: (1, 3), 4: (2, 3)}, None),  # the codes win everywhere
    ({1: (3, 1), 4: (8, 2)}, 1),  # the dense form wins everywhere
])
def test_dense_from_is_the_first_count_from_which_dense_wins(timings, expected):
    assert dense_from(timings) == expected


def test_row_counts_cover_every_batch_size_up_to_the_slots():
    assert row_counts(1) == [1] and row_counts(16) == [1, 2, 4, 8, 16] and row_counts(6) == [1, 2, 4, 6]


@torch.inference_mode()
def test_a_quantized_tied_head_reads_the_embedding_for_its_dense_form(model_dir):
    engine = Engine.from_pretrained(model_dir("tied"), EngineConfig(device="cpu", quantize="int8", max_batch_size=4,
                                                                    max_seq_len=64))
    head, embedding = engine.model.lm_head, engine.model.embed_tokens.weight
    assert isinstance(head, TiedHead) and isinstance(head.codes, Int8Linear)
    assert head.dense.weight is embedding  # the dense form costs no memory: it is the embedding itself
    x = torch.randn(3, embedding.shape[1], dtype=embedding.dtype)
    head.dense_from = 2
    assert torch.equal(head(x[:1]), head.codes(x[:1])) and torch.equal(head(x), head.dense(x))
    head.dense_from = None
    assert torch.equal(head(x), head.codes(x))
    # Both forms are the same weight: int8 codes per row vs the bfloat16 embedding.
    torch.testing.assert_close(head.codes(x).float(), head.dense(x).float(), atol=0.05, rtol=0.05)


@pytest.fixture(scope="module")
def switching_model(model_dir):
    """The tied tiny model with an int8 head that switches to the dense embedding at 3 rows."""
    path = model_dir("tied")
    config, state = load_checkpoint(path, torch.bfloat16)
    model = build_model(config, state, torch.device("cpu"), quantize="int4")
    model.lm_head = TiedHead(model.lm_head, CpuLinear(model.embed_tokens.weight, None, widen_bfloat16=False),
                             dense_from=3)
    return model, Tokenizer.from_dir(path)


def test_compiled_decode_splits_its_batches_where_the_head_switches(switching_model):
    model, tokenizer = switching_model
    settings = dict(device="cpu", max_batch_size=4, max_seq_len=64, seed=0)
    compiled = Engine(model, tokenizer, EngineConfig(compile="on", **settings))
    eager = Engine(model, tokenizer, EngineConfig(**settings))
    assert compiled.compile() and compiled.compiled_graphs == ("one", "few", "many")
    assert [compiled.executor.bucket(b) for b in (1, 2, 3, 4)] == ["one", "few", "many", "many"]
    frames = counters["frames"]["total"]
    ids = tokenizer.encode("The quick brown fox")
    with torch.inference_mode():
        for engine in (compiled, eager):
            engine.prompt_logits(ids)  # writes the prompt into slot 0
        for rows in (1, 2, 3, 4):
            args = ([5] * rows, list(range(rows)), [len(ids)] + [slot + 2 for slot in range(1, rows)])
            got, want = compiled.executor.forward(*args), eager.executor.forward(*args)
            # bfloat16 activations: inductor's fused kernels round at other points than eager ops do.
            torch.testing.assert_close(got, want, atol=0.1, rtol=0.05)
            assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
    assert counters["frames"]["total"] == frames  # every batch size ran on a graph compiled up front
