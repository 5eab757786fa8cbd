"""Layers in two forms, codes for few rows and a dense weight for many: a quantized LM head tied to the embedding
(one weight), and dense copies of the blocks' quantized layers."""

from __future__ import annotations

import httpx
import pytest
import torch
from torch._dynamo.utils import counters

from engine import Engine, EngineConfig
from engine.cpu_linear import CpuLinear
from engine.executor import batch_buckets
from engine.model import build_model
from engine.packed_linear import PackedLinear, packs_bfloat16
from engine.quantization import GroupCodes, GroupLinear, Int8Linear, group_layer, weights_bytes
from engine.sampling import SamplingParams
from engine.tokenizer import Tokenizer
from engine.two_forms import TwoForms, attach_dense_copies, dense_from, dense_weight, row_counts
from server.settings import Settings
from tests.server_harness import serve
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
    assert isinstance(head, TwoForms) and isinstance(head.codes, Int8Linear)
    assert head.dense.weight is embedding  # the dense form costs no memory: it is the embedding itself
    x = torch.randn(3, embedding.shape[1], dtype=embedding.dtype)
    head.dense_from = 2
    assert torch.equal(head(x[:1]), head.codes(x[:1])) and torch.equal(head(x), head.dense(x))
    head.dense_from = None
    assert torch.equal(head(x), head.codes(x))
    # Both forms are the same weight: int8 codes per row vs the bfloat16 embedding.
    torch.testing.assert_close(head.codes(x).float(), head.dense(x).float(), atol=0.05, rtol=0.05)


@pytest.mark.skipif(not packs_bfloat16(), reason="oneDNN computes no bfloat16 products on this CPU")
@torch.inference_mode()
def test_with_dense_copies_a_tied_head_packs_a_copy_of_the_embedding(model_dir):
    engine = Engine.from_pretrained(model_dir("tied"), EngineConfig(device="cpu", quantize="int8", max_batch_size=4,
                                                                    max_seq_len=64, dense_copies=True))
    head, embedding = engine.model.lm_head, engine.model.embed_tokens.weight
    assert isinstance(head, TwoForms)
    if head.dense_from is None:  # never faster here: no copy kept
        assert head.dense.weight is embedding
        return
    assert isinstance(head.dense, PackedLinear)
    x = torch.randn(3, embedding.shape[1], dtype=embedding.dtype)
    torch.testing.assert_close(head.dense(x), torch.nn.functional.linear(x, embedding))


@pytest.fixture(scope="module")
def switching_model(model_dir):
    """The tied tiny model with an int8 head that switches to the dense embedding at 3 rows."""
    path = model_dir("tied")
    config, state = load_checkpoint(path, torch.bfloat16)
    model = build_model(config, state, torch.device("cpu"), quantize="int4")
    model.lm_head = TwoForms(model.lm_head, CpuLinear(model.embed_tokens.weight, None, widen_bfloat16=False),
                             dense_from=3)
    return model, Tokenizer.from_dir(path)


def test_compiled_decode_splits_its_batches_where_the_head_switches(switching_model):
    model, tokenizer = switching_model
    settings = dict(device="cpu", max_batch_size=4, max_seq_len=64, seed=0)
    compiled = Engine(model, tokenizer, EngineConfig(compile="on", **settings))
    eager = Engine(model, tokenizer, EngineConfig(**settings))
    assert compiled.compile() and compiled.compiled_graphs == ("1", "2", "3+")
    assert [compiled.executor.bucket(b) for b in (1, 2, 3, 4)] == ["1", "2", "3+", "3+"]
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


@torch.inference_mode()
def test_dense_copies_hold_the_weights_the_codes_compute_with(model_dir):
    engine = Engine.from_pretrained(model_dir("gqa"), EngineConfig(device="cpu", quantize="int4", max_batch_size=4,
                                                                   max_seq_len=64))
    attach_dense_copies(engine.model, dense_from=3)
    generator = torch.Generator().manual_seed(0)
    layers = [m for m in engine.model.layers.modules() if isinstance(m, TwoForms)]
    assert len(layers) == 4 * engine.model.config.num_layers  # qkv, o, gate_up and down
    for layer in layers:
        assert isinstance(layer.codes, group_layer(4, torch.device("cpu")))
        assert isinstance(layer.dense, PackedLinear if packs_bfloat16() else CpuLinear)
        x = torch.randn(5, layer.in_features, dtype=torch.bfloat16, generator=generator)
        # The copy is the codes' own weight: the same product, rounded at other points (and, for kvserve's
        # kernels, with the inputs quantized to 8 bits per group: about 0.5% of the product).
        dense, coded = layer.dense(x).float(), layer.codes(x).float()
        assert ((coded - dense).norm() / dense.norm()).item() < 0.02
        assert torch.equal(layer(x[:2]), layer.codes(x[:2])) and torch.equal(layer(x), layer.dense(x))


def test_a_dense_copy_is_the_dequantized_codes():
    codes = GroupCodes.fit(torch.randn(64, 96), bits=4)
    layer = GroupLinear(codes, None, torch.float32)
    torch.testing.assert_close(dense_weight(layer), codes.dequantize(), atol=1e-5, rtol=1e-5)


def test_dense_copies_serve_the_same_answers(model_dir):
    settings = dict(device="cpu", quantize="int4", max_batch_size=4, max_seq_len=64, seed=0)
    codes = Engine.from_pretrained(model_dir("gqa"), EngineConfig(**settings))
    copies = Engine.from_pretrained(model_dir("gqa"), EngineConfig(**settings))
    attach_dense_copies(copies.model, dense_from=1)  # every product on the copies, prefill and decode
    prompts = [[5, 9, 14, 2, 7], [3, 3, 8]]
    params = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    # Along each greedy answer of the copies, the codes see the same next-token distributions. (Not token for
    # token: kvserve's 4-bit kernel quantizes its inputs to 8 bits, so near-ties of a random model may flip.)
    for prompt, answer in zip(prompts, copies.generate(prompts, params)):
        sequence = prompt + answer.output_ids[:-1]
        with torch.inference_mode():
            dense, coded = copies.prompt_logits(sequence).log_softmax(-1), codes.prompt_logits(sequence).log_softmax(-1)
        kl = torch.nn.functional.kl_div(coded, dense, log_target=True, reduction="none").sum(-1)  # per position
        assert kl.max().item() < 1e-3


def test_decode_buckets_split_where_any_layer_switches_within_the_slots():
    def layers(*switches):
        return torch.nn.ModuleList([TwoForms(torch.nn.Identity(), torch.nn.Identity(), n) for n in switches])

    assert batch_buckets(layers(None), slots=8) == {"1": 1, "2+": 2}
    assert batch_buckets(layers(3, 3, None), slots=4) == {"1": 1, "2": 2, "3+": 3}
    assert batch_buckets(layers(3, 6), slots=8) == {"1": 1, "2": 2, "3-5": 3, "6+": 6}
    assert batch_buckets(layers(3, 6), slots=5) == {"1": 1, "2": 2, "3+": 3}  # a switch past the slots never happens
    assert batch_buckets(layers(1, 2), slots=8) == {"1": 1, "2+": 2}
    assert batch_buckets(layers(None), slots=1) == {"1": 1}  # one slot never batches


def test_the_server_takes_dense_copies_and_counts_their_bytes(model_dir):
    with pytest.raises(ValueError, match="dense_copies must be on or off"):
        Settings(dense_copies="yes")
    sizes, copied = {}, {}
    for copies in ("off", "on"):
        with serve(model_dir("gqa"), dtype="bfloat16", quantize="int4", dense_copies=copies, max_seq_len=64) as server:
            info = httpx.get(f"{server.url}/info").json()
            reply = httpx.post(f"{server.url}/generate", json={"inputs": "hello", "parameters": {"max_new_tokens": 3}})
            assert reply.status_code == 200 and info["quantized"] is True
            sizes[copies] = info["weights_bytes"]
            # Kept only where measured faster at some row count: this machine decides whether there are any.
            copied[copies] = sum(weights_bytes(m.dense) for m in server.runner.engine.model.layers.modules()
                                 if isinstance(m, TwoForms))
    assert copied["off"] == 0 and sizes["on"] - sizes["off"] == copied["on"]
