"""W·xᵀ products: the same numbers as nn.Linear for every row count, the same parameters and state dict."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.weight_left_linear import WeightLeftLinear, use_weight_left_products


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 1), (2, 1), (1, 5), (3, 7), (1, 200)], ids=str)
def test_equals_linear_for_every_row_count(shape, bias):
    torch.manual_seed(0)
    linear = nn.Linear(48, 80, bias=bias)
    x = torch.randn(*shape, 48)
    ours = WeightLeftLinear(linear, max_rows=128)(x)  # (1, 200) takes the x·Wᵀ branch
    assert ours.shape == (*shape, 80) and ours.is_contiguous()
    torch.testing.assert_close(ours, linear(x), atol=1e-5, rtol=1e-5)


@torch.inference_mode()
def test_swapped_model_keeps_its_parameters(make_engine, model_dir):
    model = make_engine(model_dir("tied")).model  # float32 on CPU: from_pretrained already swapped the projections
    assert isinstance(model.lm_head, WeightLeftLinear) and isinstance(model.layers[0].mlp.down_proj, WeightLeftLinear)
    keys = set(model.state_dict())
    use_weight_left_products(model)  # a second swap wraps the same tensors again
    assert set(model.state_dict()) == keys
    assert model.lm_head.weight is model.embed_tokens.weight  # tied embeddings stay one tensor
