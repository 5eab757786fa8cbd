"""CPU products in another order or dtype: the same numbers as nn.Linear, the same parameters and state dict."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.linear.dense import CpuLinear, PackedLinear, packs_bfloat16


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 1), (2, 1), (1, 5), (3, 7), (1, 200)], ids=str)
def test_float32_equals_linear_for_every_row_count(shape, bias):
    torch.manual_seed(0)
    linear = nn.Linear(256, 512, bias=bias)  # 2^17 weights: large enough for W·xᵀ
    x = torch.randn(*shape, 256)
    ours = CpuLinear(linear.weight, linear.bias, widen_bfloat16=True)(x)  # 200 rows: x·Wᵀ; fewer: W·xᵀ
    assert ours.shape == (*shape, 512) and ours.is_contiguous()
    torch.testing.assert_close(ours, linear(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [3, 100])  # below and above the widening threshold
def test_bfloat16_widened_equals_bfloat16_linear(rows):
    torch.manual_seed(0)
    linear = nn.Linear(64, 96, bias=True).to(torch.bfloat16)
    x = torch.randn(1, rows, 64, dtype=torch.bfloat16)
    ours = CpuLinear(linear.weight, linear.bias, widen_bfloat16=True)(x)
    assert ours.dtype == torch.bfloat16 and ours.shape == (1, rows, 96)
    # Both accumulate in float32 and round once to bfloat16; the order of the sums may differ by an ulp.
    torch.testing.assert_close(ours, linear(x), atol=2e-2, rtol=1e-2)


@torch.inference_mode()
def test_a_planned_model_keeps_its_parameters(make_engine, model_dir):
    model = make_engine(model_dir("tied")).model  # built on the CPU: every projection planned
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, (CpuLinear, PackedLinear))} <= set(model.state_dict())
    assert model.lm_head.weight is model.embed_tokens.weight  # tied embeddings stay one tensor
    # one decision per matrix: the embedding's (what its lookups read), then every product's
    assert [d.name for d in model.plan] == ["embed_tokens"] + [
        n for n, m in model.named_modules() if isinstance(m, (CpuLinear, PackedLinear))]


@pytest.mark.skipif(not packs_bfloat16(), reason="oneDNN has no native bfloat16 products on this CPU")
@torch.inference_mode()
def test_packed_linear_computes_the_dense_product_eager_and_compiled():
    linear = nn.Linear(96, 160).to(torch.bfloat16)
    packed = PackedLinear(linear.weight, linear.bias)
    compiled = torch.compile(lambda x: packed(x) * 2, dynamic=True)
    for rows in (1, 5, 64):
        x = torch.randn(2, rows, 96, dtype=torch.bfloat16)
        torch.testing.assert_close(packed(x).float(), linear(x).float(), atol=2e-2, rtol=1e-2)
        torch.testing.assert_close(compiled(x), packed(x) * 2)  # the custom op runs unchanged in a graph


def test_packed_linear_takes_bfloat16_only():
    with pytest.raises(ValueError, match="bfloat16"):
        PackedLinear(torch.randn(4, 8), None)
