"""Attention, residual and RoPE properties, through our own modules."""

from __future__ import annotations

import math

import pytest
import torch

from engine.models.attention import broadcast_attention, grouped_attention
from engine.batch import DecodeBatch, PrefillBatch
from engine.config import ModelConfig
from engine.kv_cache import KVCache
from engine.models.layers import PreNormBlock, RMSNorm
from engine.rope import RotaryTable, apply_rope


def test_worked_example_mask_before_softmax():
    # Scaled logits (0, log 2, log 4) need q·k/sqrt(d) = those values: d = 1, q = 1, k = logits.
    q = torch.ones(1, 1, 1, 1, dtype=torch.float64)
    k = torch.tensor([0.0, math.log(2), math.log(4)], dtype=torch.float64).view(1, 1, 3, 1)
    v = torch.tensor([2.0, 7.0, 99.0], dtype=torch.float64).view(1, 1, 3, 1)
    unmasked = grouped_attention(q, k, v, None)
    assert unmasked.item() == pytest.approx(412 / 7, rel=1e-12)
    masked = grouped_attention(q, k, v, torch.tensor([True, True, False]).view(1, 1, 1, 3))
    assert masked.item() == pytest.approx(16 / 3, rel=1e-12)


def test_grouped_attention_equals_repeated_heads():
    torch.manual_seed(0)
    q = torch.randn(2, 8, 5, 16)
    k, v = torch.randn(2, 2, 5, 16), torch.randn(2, 2, 5, 16)
    mask = torch.ones(5, 5, dtype=torch.bool).tril()[None, None]
    ours = grouped_attention(q, k, v, mask)
    # The textbook form: each K/V head copied for its 4 query heads (what the cache never stores).
    reference = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1), is_causal=True)
    torch.testing.assert_close(ours, reference)


def test_broadcast_attention_equals_grouped_attention_for_one_query_per_row():
    # The compiled decode step's form: one query per row, each row its own filled length.
    torch.manual_seed(0)
    q = torch.randn(3, 6, 1, 16)
    k, v = torch.randn(3, 2, 7, 16), torch.randn(3, 2, 7, 16)
    mask = (torch.arange(7)[None, :] <= torch.tensor([[2], [6], [4]]))[:, None, None, :]  # (3, 1, 1, 7)
    torch.testing.assert_close(broadcast_attention(q, k, v, mask), grouped_attention(q, k, v, mask))
    # A key hidden by the mask changes nothing, however large.
    k[0, :, 3:] = 1e4
    torch.testing.assert_close(broadcast_attention(q, k, v, mask)[0], grouped_attention(q, k, v, mask)[0])


def tiny_config(**overrides) -> ModelConfig:
    settings = dict(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                    num_kv_heads=2, head_dim=8, max_position_embeddings=64)
    return ModelConfig(**(settings | overrides))


@torch.inference_mode()
def test_block_with_zeroed_branches_returns_its_input():
    config = tiny_config()
    torch.manual_seed(0)
    block = PreNormBlock(config, 0, RMSNorm, qk_norm=False)
    for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
        block.get_parameter(name).data.zero_()
    cache = KVCache(config, slots=1, max_seq_len=16, device=torch.device("cpu"), dtype=torch.float32)
    rotary = RotaryTable(config, 16, torch.device("cpu"), torch.float32)
    batch = PrefillBatch(slots=[0], starts=[0], lengths=[5], device=torch.device("cpu"))
    x = torch.randn(1, 5, config.hidden_size) * 3
    out = block(x, rotary.lookup(batch.positions), cache.layer(0), batch)
    assert torch.equal(out, x)


def test_rope_scores_depend_only_on_offset():
    config = tiny_config(head_dim=16)
    rotary = RotaryTable(config, 64, torch.device("cpu"), torch.float64)
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 1, 16, dtype=torch.float64), torch.randn(1, 1, 1, 16, dtype=torch.float64)

    def score(m: int, n: int) -> float:
        cos_q, sin_q = rotary.lookup(torch.tensor([[m]]))["global"]
        cos_k, sin_k = rotary.lookup(torch.tensor([[n]]))["global"]
        return (apply_rope(q, cos_q, sin_q) * apply_rope(k, cos_k, sin_k)).sum().item()

    # Angles are tabulated in float32, as the reference implementation computes them.
    assert score(3, 10) == pytest.approx(score(20, 27), rel=1e-6)
    assert score(10, 3) == pytest.approx(score(40, 33), rel=1e-6)
    assert abs(score(3, 10) - score(10, 3)) > 1e-6  # the sign of the offset matters


@torch.inference_mode()
def test_decode_writes_the_same_keys_as_prefill():
    """A token decoded at position p leaves the cache exactly as prefilling it at p would."""
    config = tiny_config()
    torch.manual_seed(0)
    block = PreNormBlock(config, 0, RMSNorm, qk_norm=False)
    cpu = torch.device("cpu")
    rotary = RotaryTable(config, 16, cpu, torch.float32)
    x = torch.randn(1, 6, config.hidden_size)
    whole = KVCache(config, 1, 16, cpu, torch.float32)
    batch = PrefillBatch([0], [0], [6], cpu)
    expected = block(x, rotary.lookup(batch.positions), whole.layer(0), batch)
    stepped = KVCache(config, 2, 16, cpu, torch.float32)  # slot 1 this time, to exercise the slot index
    batch = PrefillBatch([1], [0], [5], cpu)
    block(x[:, :5], rotary.lookup(batch.positions), stepped.layer(0), batch)
    step = DecodeBatch([1], [5], cpu)
    last = block(x[:, 5:], rotary.lookup(step.positions), stepped.layer(0), step)
    torch.testing.assert_close(last[0, 0], expected[0, 5])
    torch.testing.assert_close(stepped.groups[0][:, :, 1, :, :6], whole.groups[0][:, :, 0, :, :6])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h_q, h_kv", [(4, 4), (6, 2), (4, 1), (10, 2), (18, 2)])
def test_our_decode_attention_reads_each_rows_keys_in_the_cache(dtype, h_q, h_kv):
    """kvserve's kernel (CPU decode) against grouped_attention over each row's keys taken out of the cache; row
    lengths from one key to several chunks of 256, slots in any order and twice; 1 to 9 query heads per K/V head
    (its weighted values go up to 8 heads at a time, in registers sized by the head count)."""
    from engine.linear.native import load_kernels

    if load_kernels() is not None:
        pytest.skip(f"kvserve's kernels are off here: {load_kernels()}")
    generator = torch.Generator().manual_seed(0)
    keys, values = (torch.randn(5, h_kv, 700, 32, generator=generator).to(dtype) for _ in range(2))
    slots, positions = torch.tensor([3, 0, 4, 3, 1]), torch.tensor([[0], [255], [256], [699], [300]])
    q = torch.randn(5, h_q, 1, 32, generator=generator).to(dtype)
    got = torch.ops.kvserve.decode_attention(q, keys, values, slots, positions, 0)
    for r in range(5):
        n = positions[r, 0] + 1
        want = grouped_attention(q[r:r + 1].float(), keys[slots[r], None, :, :n].float(),
                                 values[slots[r], None, :, :n].float(), None)
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # bfloat16: the output's own rounding
        torch.testing.assert_close(got[r:r + 1].float(), want, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h_q, h_kv, d", [(9, 3, 64), (32, 2, 32), (8, 2, 128)])
def test_our_decode_attention_gives_a_row_the_same_bits_beside_its_slots_other_rows(dtype, h_q, h_kv, d):
    """A step verifying drafts attends from several positions of one slot side by side (with AMX, they share each
    tile product); each row's result is the one it gets decoded alone, bit for bit, across a chunk's end too."""
    from engine.linear.native import load_kernels

    if load_kernels() is not None:
        pytest.skip(f"kvserve's kernels are off here: {load_kernels()}")
    generator = torch.Generator().manual_seed(d)
    keys, values = (torch.randn(3, h_kv, 600, d, generator=generator).to(dtype) for _ in range(2))
    slots = torch.tensor([1, 1, 1, 1, 1, 1, 0, 2, 2])
    positions = torch.tensor([[252], [253], [254], [255], [256], [257], [9], [599], [0]])
    q = torch.randn(9, h_q, 1, d, generator=generator).to(dtype)
    together = torch.ops.kvserve.decode_attention(q, keys, values, slots, positions, 0)
    for r in range(9):
        alone = torch.ops.kvserve.decode_attention(q[r:r + 1].contiguous(), keys, values, slots[r:r + 1],
                                                   positions[r:r + 1], 0)
        assert torch.equal(alone, together[r:r + 1])
        n = positions[r, 0] + 1
        want = grouped_attention(q[r:r + 1].float(), keys[slots[r], None, :, :n].float(),
                                 values[slots[r], None, :, :n].float(), None)
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(together[r:r + 1].float(), want, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("capacity", [700, 300, 303])
def test_our_decode_attention_reads_only_the_window(capacity):
    """A sliding layer's keys: the window's last ones, in a full-length layer (capacity 700), a ring that holds
    only the window (300 entries, position p at entry p mod 300, rows past its end reading all of it) or a ring
    that also holds 3 positions of drafts (303 entries: past its end, the window's entries wrap around it)."""
    from engine.linear.native import load_kernels

    if load_kernels() is not None:
        pytest.skip(f"kvserve's kernels are off here: {load_kernels()}")
    window = 300
    generator = torch.Generator().manual_seed(1)
    keys, values = (torch.randn(3, 2, capacity, 16, generator=generator) for _ in range(2))
    slots = torch.tensor([0, 2, 1, 2, 0])
    positions = torch.tensor([[10], [299], [650 if capacity < 700 else 450], [302], [303]])
    q = torch.randn(5, 4, 1, 16, generator=generator)
    got = torch.ops.kvserve.decode_attention(q, keys, values, slots, positions, window)
    for r in range(5):
        p = int(positions[r, 0])
        held = [t % capacity for t in range(max(0, p - window + 1), p + 1)]  # the window's entries
        want = grouped_attention(q[r:r + 1], keys[slots[r]][None, :, held], values[slots[r]][None, :, held], None)
        torch.testing.assert_close(got[r:r + 1], want, atol=1e-5, rtol=1e-5)
