"""The KV cache: its exact size, GQA's saving, and slot reuse."""

from __future__ import annotations

import logging

import pytest
import torch

from engine import SamplingParams
from engine.kv_cache import KVCache, parse_bytes
from tests.test_attention import tiny_config


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_allocation_equals_formula(dtype):
    config = tiny_config(num_layers=3, num_heads=8, num_kv_heads=2, head_dim=16)
    cache = KVCache(config, slots=5, max_seq_len=40, device=torch.device("cpu"), dtype=dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    expected = 2 * 5 * 3 * 40 * 2 * 16 * itemsize  # 2·B·L·T·h_kv·d_h·itemsize
    assert cache.capacity_bytes == expected
    assert cache.data.untyped_storage().nbytes() == expected


def test_gqa_allocates_a_quarter_of_mha():
    cpu = torch.device("cpu")
    mha = KVCache(tiny_config(num_heads=8, num_kv_heads=8), 4, 32, cpu, torch.float32)
    gqa = KVCache(tiny_config(num_heads=8, num_kv_heads=2), 4, 32, cpu, torch.float32)
    assert gqa.data.untyped_storage().nbytes() * 4 == mha.data.untyped_storage().nbytes()
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
    assert engine.cache_used_bytes == 4 * engine.cache.bytes_per_token
    engine.step()
    assert engine.cache_used_bytes == 5 * engine.cache.bytes_per_token
    engine.abort(request.request_id)
    assert engine.cache_used_bytes == 0
