"""The KV cache: its exact size, GQA's saving, and slot reuse."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from engine import SamplingParams
from engine.kv_cache import KVCache, parse_bytes, ring_readable
from tests.test_attention import tiny_config


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_allocation_equals_formula(dtype):
    config = tiny_config(num_layers=3, num_heads=8, num_kv_heads=2, head_dim=16)
    cache = KVCache(config, slots=5, max_seq_len=40, device=torch.device("cpu"), dtype=dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    expected = 2 * 5 * 3 * 40 * 2 * 16 * itemsize  # 2·B·L·T·h_kv·d_h·itemsize
    assert cache.capacity_bytes == expected
    assert cache.storage.untyped_storage().nbytes() == expected


def resident_bytes() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads resident memory from /proc")
@torch.inference_mode()
def test_a_cpu_cache_is_resident_only_where_written():
    """The whole allocation exists (and reads as zeros) from the start; the system supplies its pages as positions are
    first written, so 256 MiB of slots cost what their used positions take, as llama.cpp's cache does."""
    config = tiny_config(num_layers=4, num_heads=8, num_kv_heads=2, head_dim=128)
    before = resident_bytes()
    cache = KVCache(config, slots=16, max_seq_len=4096, device=torch.device("cpu"), dtype=torch.bfloat16)
    assert cache.capacity_bytes == 256 << 20 and cache.storage.untyped_storage().nbytes() == 256 << 20
    assert resident_bytes() - before < 16 << 20
    layer = cache.layer(3)
    layer.keys[5, :, :100] = 1.0  # slot 5's first 100 positions of one layer's keys: 2 heads x 25 KiB
    layer.values[15, :, 4000:] = 2.0
    assert resident_bytes() - before < 16 << 20
    assert layer.keys[5, :, :100].eq(1).all() and layer.keys[5, :, 100:].eq(0).all() and layer.keys[4].eq(0).all()
    assert layer.values[15, :, 4000:].eq(2).all() and cache.layer(0).keys.eq(0).all()
    cache.storage.fill_(3.0)  # every position written: then all of it is resident
    assert resident_bytes() - before > 250 << 20


def sliding_config(**overrides):
    """Gemma 3's pattern in four layers: three sliding layers of an 8-key window, then a global one."""
    return tiny_config(num_layers=4, num_heads=8, num_kv_heads=2, head_dim=16, sliding_window=8,
                       layer_types=("sliding_attention",) * 3 + ("full_attention",), **overrides)


@pytest.mark.parametrize("full_windows", [False, True])
def test_sliding_layers_hold_only_their_window(full_windows):
    cache = KVCache(sliding_config(), slots=5, max_seq_len=40, device=torch.device("cpu"), dtype=torch.bfloat16,
                    full_windows=full_windows)
    window = 40 if full_windows else 8
    expected = 2 * 5 * (1 * 40 + 3 * window) * 2 * 16 * 2  # 2·B·(L_global·T + L_sliding·W)·h_kv·d_h·itemsize
    assert cache.capacity_bytes == cache.storage.untyped_storage().nbytes() == expected
    assert cache.full_length_bytes == 2 * 5 * 4 * 40 * 2 * 16 * 2
    assert [cache.layer(i).keys.shape for i in range(4)] == [(5, 2, window, 16)] * 3 + [(5, 2, 40, 16)]
    assert [cache.layer(i).ring for i in range(4)] == [not full_windows] * 3 + [False]
    assert cache.ring_capacity == (None if full_windows else 8)
    assert cache.used_bytes(20) == 2 * (40 // 2 + 3 * min(20, window)) * 2 * 16 * 2  # each layer's min(20, C_l)
    cache.storage.fill_(1)  # the layers' views are the one allocation, and no two overlap
    for i in range(4):
        cache.layer(i).keys.zero_()
    assert int((cache.storage == 0).sum()) == cache.storage.numel() // 2


def test_a_ring_holds_its_window_and_the_lookahead_of_verified_drafts():
    """With speculative decoding a step writes K positions past the newest token: each ring holds W + K entries
    (capped at T), and the formula says so."""
    cache = KVCache(sliding_config(), slots=5, max_seq_len=40, device=torch.device("cpu"), dtype=torch.bfloat16,
                    lookahead=3)
    assert cache.capacities == (11, 11, 11, 40) and cache.ring_capacity == 11
    assert cache.capacity_bytes == 2 * 5 * (40 + 3 * 11) * 2 * 16 * 2
    terms = cache.terms()
    assert terms["formula"] == "2*B*(L_global*T + L_sliding*(W+K))*h_kv*d_h*itemsize" and (terms["W"], terms["K"]) == (8, 3)
    assert KVCache(sliding_config(), 5, 10, torch.device("cpu"), torch.bfloat16, lookahead=3).ring_capacity is None


@pytest.mark.parametrize("capacity", [4, 7])
def test_a_ring_reads_exactly_the_window_of_each_position(capacity):
    """ring_readable: the entries of positions p - W + 1 .. p (W = 4), never one of a newer position (a draft),
    in a ring of the window alone or of the window and 3 positions of lookahead."""
    window, positions = 4, torch.arange(30)[:, None]
    readable = ring_readable(positions, capacity, window, capacity - window)
    for p in range(30):
        held = {t % capacity for t in range(max(0, p - window + 1), p + 1)}
        assert set(readable[p].nonzero().flatten().tolist()) == held


def test_budget_sizing_counts_the_windows():
    config = sliding_config()
    per_slot = 2 * (40 + 3 * 8) * 2 * 16 * 4
    assert KVCache.slots_for_budget(config, 40, 7 * per_slot + 1, torch.float32) == 7
    assert KVCache.slots_for_budget(config, 40, 7 * per_slot, torch.float32, full_windows=True) < 7


def test_gqa_allocates_a_quarter_of_mha():
    cpu = torch.device("cpu")
    mha = KVCache(tiny_config(num_heads=8, num_kv_heads=8), 4, 32, cpu, torch.float32)
    gqa = KVCache(tiny_config(num_heads=8, num_kv_heads=2), 4, 32, cpu, torch.float32)
    assert gqa.storage.untyped_storage().nbytes() * 4 == mha.storage.untyped_storage().nbytes()
    assert gqa.mha_capacity_bytes == mha.capacity_bytes


def test_engine_cache_matches_its_model(make_engine):
    engine = make_engine(max_batch_size=3, max_seq_len=100)
    c = engine.model.config
    assert engine.cache.capacity_bytes == 2 * 3 * c.num_layers * 100 * c.num_kv_heads * c.head_dim * 4
    assert engine.max_seq_len == 100


def test_budget_sizing_takes_the_largest_batch_that_fits(make_engine):
    engine = make_engine(max_seq_len=64, kv_cache_memory="100KiB")
    c = engine.model.config
    per_slot = 2 * c.num_layers * 64 * c.num_kv_heads * c.head_dim * 4
    assert engine.cache.slots == (100 * 1024) // per_slot
    assert engine.cache.capacity_bytes <= 100 * 1024 < engine.cache.capacity_bytes + per_slot
    with pytest.raises(ValueError, match="holds no sequence"):
        make_engine(max_seq_len=64, kv_cache_memory=100)


def test_parse_bytes():
    assert parse_bytes("1GiB") == 1 << 30
    assert parse_bytes("512 MiB") == 512 << 20
    assert parse_bytes("2GB") == 2 * 10**9
    with pytest.raises(ValueError, match="size"):
        parse_bytes("lots")


def test_start_logs_one_line_with_the_sizes(make_engine, caplog):
    with caplog.at_level(logging.INFO, logger="kvserve.engine"):
        make_engine(max_batch_size=2, max_seq_len=64)
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache:")]
    assert line == "KV cache: 2 slots x 64 tokens, 2 layers, 2 kv heads x 8, float32 = 32.0 KiB (MHA would need 128.0 KiB)"


def test_max_seq_len_beyond_model_context_is_refused(make_engine):
    with pytest.raises(ValueError, match="max_position_embeddings 256"):
        make_engine(max_seq_len=1000)


def test_slots_are_reused_after_finish_and_abort(make_engine):
    engine = make_engine(max_batch_size=2)
    greedy = SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True)
    a = engine.add_request("The quick", greedy)
    b = engine.add_request("Paris", SamplingParams(max_new_tokens=50, temperature=0, ignore_eos=True))
    c = engine.add_request("Once upon", greedy)
    engine.step()
    assert (a.slot, b.slot, c.slot) == (0, 1, None) and engine.num_waiting == 1
    while not a.finished:
        engine.step()
    assert engine.scheduler.free_slots == [0]  # freed the moment it finished
    engine.step()
    assert c.slot == 0  # the waiting request took it on the next step
    assert engine.abort(b.request_id)
    assert engine.num_running == 1 and 1 in engine.scheduler.free_slots
    d = engine.add_request("Berlin", greedy)
    engine.step()
    assert d.slot == 1
    assert not engine.abort(b.request_id)  # already gone


def test_used_bytes_counts_held_tokens(make_engine):
    engine = make_engine()
    request = engine.add_request([5, 6, 7, 8], SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True))
    engine.step()  # prefill: 4 positions cached, 1 token generated (not yet cached)
    per_token = 2 * engine.cache.num_layers * engine.cache.num_kv_heads * engine.cache.head_dim * 4  # float32
    assert engine.cache_used_bytes == 4 * per_token
    engine.step()
    assert engine.cache_used_bytes == 5 * per_token
    engine.abort(request.request_id)
    assert engine.cache_used_bytes == 0
