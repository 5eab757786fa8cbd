"""The RMS norms on kvserve's kernel: torch's arithmetic to the last bit of a bfloat16 step, and a row's bits the same
alone, beside other rows and inside a compiled graph (which torch's own norm does not keep: its sum of squares
follows the code inductor generates)."""

from __future__ import annotations

import pytest
import torch

from engine.linear.native import load_kernels
from engine.models.layers import OffsetRMSNorm, RMSNorm

pytestmark = pytest.mark.skipif(load_kernels() is not None, reason=f"kvserve's kernels are off here: {load_kernels()}")

OPTIONS = {"cpp_wrapper": True, "emulate_precision_casts": True}  # the decode step's (engine/executor.py)


def norm(kind: type[RMSNorm], size: int, dtype: torch.dtype, by_kernel: bool, seed: int = 0) -> RMSNorm:
    layer = kind(size, 1e-6)
    generator = torch.Generator().manual_seed(seed)
    layer.weight.data = (torch.rand(size, generator=generator) * 2 - 0.5).to(dtype)
    layer.by_kernel = by_kernel
    return layer.eval().requires_grad_(False)


@pytest.mark.parametrize("kind", [RMSNorm, OffsetRMSNorm])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("size", [64, 576, 100])  # 100: a tail past the last 8
def test_the_kernel_is_torchs_norm(kind, dtype, size):
    by_kernel, by_torch = norm(kind, size, dtype, True), norm(kind, size, dtype, False)
    x = (torch.randn(7, 3, size, generator=torch.Generator().manual_seed(size)) * 4).to(dtype)
    with torch.inference_mode():
        got, want = by_kernel(x), by_torch(x)
    assert got.dtype == dtype and got.shape == x.shape
    # The sums of squares are added in another order: in bfloat16 at most a step apart, on a few values; in float32
    # a few steps (the sum's and the root's own rounding).
    steps = 2 if dtype == torch.bfloat16 else 16
    assert ((got.float() - want.float()).abs() <= steps * torch.finfo(dtype).eps * want.abs().float() + 1e-30).all()
    if dtype == torch.bfloat16:
        assert (got == want).float().mean().item() > 0.97


@pytest.mark.parametrize("kind", [RMSNorm, OffsetRMSNorm])
def test_a_rows_bits_are_the_same_alone_beside_others_and_compiled(kind):
    layer = norm(kind, 576, torch.bfloat16, True)
    x = (torch.randn(64, 1, 576, generator=torch.Generator().manual_seed(1)) * 4).to(torch.bfloat16)
    compiled = torch.compile(layer, options=OPTIONS, dynamic=True)
    with torch.inference_mode():
        alone = torch.cat([layer(x[r: r + 1]) for r in range(len(x))])
        assert torch.equal(layer(x), alone)
        assert torch.equal(compiled(x), alone)
        assert torch.equal(compiled(x[:1]), alone[:1])
        # a residual added before the norm, fused by inductor into the step: the norm still reads the rounded sum
        residual = torch.compile(lambda a, b: layer(a + b), options=OPTIONS, dynamic=True)
        assert torch.equal(residual(x, x.flip(0)), layer(x + x.flip(0)))


def test_a_non_contiguous_input_is_normalized_as_its_copy():
    layer = norm(RMSNorm, 64, torch.bfloat16, True)
    heads = torch.randn(2, 5, 3, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).transpose(1, 2)
    with torch.inference_mode():
        assert torch.equal(layer(heads), layer(heads.contiguous()))
