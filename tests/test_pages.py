"""The weights on huge pages (engine/pages.py): a loaded model's tensors in one region, ties kept, the same logits
as the same model left where it was built."""

from __future__ import annotations

import pytest
import torch

from engine import EngineConfig
from engine.executor import DecodeExecutor
from engine.kv_cache import KVCache
from engine.linear.planner import Planner
from engine.models.model import build_model
from engine.pages import ALIGNMENT, HUGE_PAGE, Placement, onto_huge_pages
from engine.rope import RotaryTable
from weights.loading import load_model, served_checkpoint


def tensors(model) -> dict[str, torch.Tensor]:
    named = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    return {name: t for name, t in named.items() if t.layout == torch.strided and not t.is_mkldnn}


def sharing(model) -> set[frozenset[str]]:
    """Names grouped by the memory they read: a tied head's weight and the embedding's are one group."""
    groups: dict[int, set[str]] = {}
    for name, tensor in tensors(model).items():
        groups.setdefault(tensor.data_ptr(), set()).add(name)
    return {frozenset(names) for names in groups.values()}


def logits(model, tokens: list[int]) -> torch.Tensor:
    """Each token's next-token logits, decoded one by one through the model's own cache."""
    config = model.config
    cache = KVCache(config, 1, 16, torch.device("cpu"), next(model.parameters()).dtype)
    executor = DecodeExecutor(model, RotaryTable(config, 16, torch.device("cpu"), cache.dtype), cache)
    return torch.cat([executor.forward([token], [0], [at]) for at, token in enumerate(tokens)])


@pytest.mark.parametrize("variant, dtype, quantize", [("qwen2_bias", "float32", "none"), ("wide", "bfloat16", "int4")])
def test_loaded_weights_lie_in_one_region_and_give_the_same_logits(model_dir, variant, dtype, quantize):
    """Dense float32 with a tied head and biases; 4-bit codes with their scales (buffers, not parameters)."""
    path, device = model_dir(variant), torch.device("cpu")
    config = EngineConfig(device="cpu", dtype=dtype, quantize=quantize, max_batch_size=1, max_seq_len=16)
    model_config, state, mode = served_checkpoint(path, config.quantize, config.dtype, device)
    kept = build_model(model_config, state, device, Planner.for_machine(device, mode, config.dense_copies))
    moved = load_model(path, config)
    assert [type(d.layer) for d in moved.plan] == [type(d.layer) for d in kept.plan]

    assert kept.pages == Placement(0, 0) and "not moved" in kept.pages.describe()
    unique = {t.data_ptr(): t for t in tensors(moved).values()}
    assert moved.pages.moved == sum(-(-t.nbytes // ALIGNMENT) * ALIGNMENT for t in unique.values())
    start = min(unique)
    assert start % HUGE_PAGE == 0 and all(p % ALIGNMENT == 0 for p in unique)
    assert max(p + t.nbytes for p, t in unique.items()) <= start + moved.pages.moved
    assert 0 <= moved.pages.huge <= moved.pages.moved and "MiB in one region" in moved.pages.describe()
    assert sharing(moved) == sharing(kept)
    for name, tensor in tensors(moved).items():
        assert torch.equal(tensor, tensors(kept)[name]), name

    tokens = [3, 17, 42, 7, 99]
    if quantize == "none":  # the BLAS picks its float32 paths by the operands' alignment: the last bits may move
        torch.testing.assert_close(logits(moved, tokens), logits(kept, tokens), rtol=0, atol=1e-5)
    else:  # kvserve's own kernels: the same bits wherever the codes lie
        assert torch.equal(logits(moved, tokens), logits(kept, tokens))


def test_a_model_without_cpu_tensors_stays_put():
    assert onto_huge_pages(torch.nn.Linear(4, 4, device="meta")) == Placement(0, 0)


def test_a_placement_holds_no_more_huge_pages_than_it_moved():
    with pytest.raises(ValueError, match="within"):
        Placement(HUGE_PAGE, 3 * HUGE_PAGE)
