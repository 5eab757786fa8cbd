"""Weight-only int4 and int8: exact on weights already on their grid, close on the rest, refused where they cannot run."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine import Engine, EngineConfig, SamplingParams
from engine.quantization import Int4Linear, Int8Linear


def test_int4_is_exact_for_weights_stored_as_q4_1_blocks():
    torch.manual_seed(0)
    out_features, in_features = 48, 64
    codes = torch.randint(0, 16, (out_features, in_features // 32, 32)).float()
    codes[..., 0], codes[..., 1] = 0, 15  # every block spans all 16 levels, as a min/max quantizer sees it
    scale = torch.rand(out_features, in_features // 32, 1) * 0.1 + 0.01
    low = torch.randn(out_features, in_features // 32, 1) * 0.1
    linear = nn.Linear(in_features, out_features, bias=True)
    with torch.no_grad():
        linear.weight.copy_((codes * scale + low).reshape(out_features, in_features))
    x = torch.randn(5, in_features)
    with torch.inference_mode():
        expected = linear(x)
        got = Int4Linear(linear)(x)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_int8_is_exact_for_weights_on_a_per_row_grid():
    torch.manual_seed(0)
    codes = torch.randint(-127, 128, (48, 64)).float()
    codes[:, 0] = 127  # every row reaches the top code, as an absmax quantizer sees it
    scale = torch.rand(48, 1) * 0.01 + 0.001
    linear = nn.Linear(64, 48, bias=True)
    with torch.no_grad():
        linear.weight.copy_(codes * scale)
    x = torch.randn(5, 64)
    with torch.inference_mode():
        torch.testing.assert_close(Int8Linear(linear)(x), linear(x), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind,layer", [("int4", Int4Linear), ("int8", Int8Linear)])
def test_quantized_engine_stays_close_to_dense(tiny_dir, kind, layer):
    settings = dict(device="cpu", max_batch_size=2, max_seq_len=128)
    dense = Engine.from_pretrained(tiny_dir, EngineConfig(dtype="bfloat16", **settings))
    int4 = Engine.from_pretrained(tiny_dir, EngineConfig(quantize=kind, **settings))
    assert int4.dtype == torch.bfloat16
    assert isinstance(int4.model.layers[0].mlp.down_proj, layer) and isinstance(int4.model.lm_head, Int8Linear)
    ids = int4.tokenizer.encode("The quick brown fox jumps over the lazy dog")
    a, b = dense.prompt_logits(ids), int4.prompt_logits(ids)
    # 4-bit weights move logits a little; the distribution over next tokens stays nearly the same.
    kl = torch.nn.functional.kl_div(b.log_softmax(-1), a.log_softmax(-1), log_target=True, reduction="batchmean")
    assert kl.item() < 0.05
    (completion,) = int4.generate([ids], SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True))
    assert len(completion.output_ids) == 8


def test_int4_refuses_float32_and_unknown_schemes():
    with pytest.raises(ValueError, match="computes in bfloat16"):
        EngineConfig(quantize="int4", dtype="float32")
    with pytest.raises(ValueError, match="quantize must be None, 'int4', 'int8'"):
        EngineConfig(quantize="int3")
