"""Weight-only quantization: GGUF's blocks served exactly as stored, float weights close, refused where it cannot run."""

from __future__ import annotations

import platform
import shutil
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from engine import EngineConfig, SamplingParams
from engine.device import cpu_description
from engine.linear.native import load_kernels, load_or_build
from engine.linear.timing import BFLOAT16_TILES, INTEGER_TILES, ProductForms, crossovers
from engine.linear.codes import GroupCodes, StackedCodes, SubBlockCodes, SuperBlockCodes, fuse
from engine.linear.planner import Machine, Planner, Role, codes_layer_class
from engine.linear.quantized import GroupLinear, Int8Linear, StackedLinear, SubBlock6Linear, SuperBlockLinear
from tests.test_gguf import write_minimal_gguf
from tests.tiny import quantize_q4_k, quantize_q5_k, quantize_q6_k
from weights.gguf_file import GGUFFile
from weights.loading import load_engine


def codes_layer(bits: int):
    """The layer class that serves group codes of `bits` on this machine (the planner's choice)."""
    return codes_layer_class(bits, Machine.found(torch.device("cpu")))


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_0,
                                   GGMLQuantizationType.Q5_1, GGMLQuantizationType.Q8_0])
def test_gguf_blocks_serve_the_product_of_their_dequantized_weights(tmp_path, qtype):
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((48, 96)).astype(np.float32) * 0.05
    weight[:, :32] += 0.1  # groups whose minimum is not their negated maximum
    path = write_minimal_gguf(tmp_path / "blocks.gguf", "llama", {"blk.0.ffn_up.weight": (quantize(weight, qtype), qtype)})
    (tensor,) = GGUFFile(path).reader.tensors
    codes = GGUFFile.group_codes(tensor)
    stored = torch.from_numpy(dequantize(np.asarray(tensor.data), qtype).reshape(48, 96))  # gguf's own reading
    assert codes.bits == int(qtype.name[1]) and codes.served == (f"{qtype.name} as stored",)
    torch.testing.assert_close(codes.dequantize(), stored, atol=1e-6, rtol=1e-5)
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(0))
    expected = x.bfloat16().float() @ stored.t()
    with torch.inference_mode():
        got = GroupLinear(codes, bias=None)(x.bfloat16()).float()
        ours = codes_layer(codes.bits)(codes, None, torch.float32)(x)
    # bfloat16 activations, scales and output: within a few bf16 roundings of the float32 product
    torch.testing.assert_close(got, expected, atol=0.02 * expected.abs().max().item(), rtol=0.02)
    # ours: the codes times the inputs quantized to 8 bits per group of 32
    torch.testing.assert_close(ours, x @ stored.t(), atol=0.02 * expected.abs().max().item(), rtol=0.02)


K_QUANTS = {"Q4_K": (GGMLQuantizationType.Q4_K, quantize_q4_k, SuperBlockCodes, SuperBlockLinear),
            "Q5_K": (GGMLQuantizationType.Q5_K, quantize_q5_k, SuperBlockCodes, SuperBlockLinear),
            "Q6_K": (GGMLQuantizationType.Q6_K, quantize_q6_k, SubBlockCodes, SubBlock6Linear)}


def k_quant_file(tmp_path, kind: str = "Q4_K", rows: int = 37, columns: int = 512):
    """A GGUF holding one matrix of random weights in `kind` (groups whose minimum is not their negated maximum): its
    tensor, and the weights as the gguf library reads them (it reads K-quants but does not write them)."""
    qtype, quantize_blocks, _, _ = K_QUANTS[kind]
    rng = np.random.default_rng(0)
    weight = (rng.standard_normal((rows, columns)) * 0.05).astype(np.float32)
    weight[:, :32] += 0.1
    path = write_minimal_gguf(tmp_path / "k.gguf", "llama", {"blk.0.ffn_up.weight": (quantize_blocks(weight), qtype)})
    (tensor,) = GGUFFile(path).reader.tensors
    return tensor, torch.from_numpy(dequantize(np.asarray(tensor.data), qtype).reshape(rows, columns))


@pytest.mark.parametrize("kind", K_QUANTS)
@pytest.mark.parametrize("rows", [1, 3, 4, 16, 70])
def test_k_quants_are_read_as_stored_and_multiplied_on_our_kernels(tmp_path, kind, rows):
    tensor, stored = k_quant_file(tmp_path, kind)
    _, _, layout, layer_class = K_QUANTS[kind]
    codes = GGUFFile.group_codes(tensor)
    assert isinstance(codes, layout) and codes.served == (f"{kind} as stored",)
    assert torch.equal(codes.dequantize(), stored)  # the file's own weights, not a second quantization
    if load_kernels() is not None:
        pytest.skip(f"kvserve's kernels are off here: {load_kernels()}")
    layer = layer_class(codes, torch.randn(37), torch.float32)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    with torch.inference_mode():
        got = layer(x) - layer.bias
        one_hot = layer(torch.eye(512)) - layer.bias
    exact = x @ stored.t()
    assert got.shape == (rows, 37)
    assert ((got - exact).norm() / exact.norm()).item() < 0.01  # as the Q4_0 kernel: 8-bit inputs
    torch.testing.assert_close(one_hot, stored.t(), atol=1e-5, rtol=1e-5)


def test_q4_k_without_our_kernels_is_its_groups_on_torchs(tmp_path):
    tensor, stored = k_quant_file(tmp_path, rows=48)  # torch's int4 kernel takes whole tiles of 16 rows
    decision = Planner(Machine(torch.device("cpu"), kernels_off="no C++ compiler"), "auto").plan(
        GGUFFile.group_codes(tensor), None, Role("layers.0.mlp.down_proj"))
    assert isinstance(decision.layer, GroupLinear)
    assert decision.served == ("Q4_K as 4-bit groups (d·sc and dmin·mn in float16)",)
    x = torch.randn(3, 512)
    with torch.inference_mode():
        got = decision.layer(x.bfloat16()).float()
    expected = x.bfloat16().float() @ stored.t()
    torch.testing.assert_close(got, expected, atol=0.02 * expected.abs().max().item(), rtol=0.02)


def test_our_kernels_build_on_this_machine():
    if shutil.which("g++") is None or platform.machine() != "x86_64":
        pytest.skip("kvserve's kernels are built by g++ for x86-64")
    assert load_kernels() is None  # else every 8-bit layer silently takes the slower int4 halves


@pytest.mark.parametrize("arch, feature", [("haswell", "avx2"), ("icelake-server", "avx512_vnni")])
def test_our_kernels_also_build_and_compute_for_older_cpus(tmp_path, arch, feature):
    """This machine's build takes the paths its CPU has (AMX, AVX512-VNNI or AVX2; the decode attention's bfloat16
    pairs with AVX512_BF16); the others are built for an older CPU and run here (haswell: AVX2 alone; icelake-server:
    AVX512-VNNI without AMX or bfloat16 pairs), each in a process of its own: the ops register once per process."""
    if shutil.which("g++") is None or platform.machine() != "x86_64" or feature not in cpu_description():
        pytest.skip(f"needs g++ and an x86-64 CPU with {feature}")
    script = f"""
from pathlib import Path
import torch
from engine.linear.native import build
from engine.linear.timing import ProductForms
from engine.linear.codes import GroupCodes
from engine.linear.codes import SuperBlockCodes
from engine.linear.quantized import Codes4Linear, Codes5Linear, Codes8Linear, SubBlock6Linear, SuperBlockLinear
from tests.test_quantization import eight_bit_codes, random_q4_k, random_q5_k, random_q6_k
build("g++", Path({str(tmp_path / "kernels.so")!r}), arch={arch!r})
torch.ops.load_library({str(tmp_path / "kernels.so")!r})
torch.manual_seed(0)
x = torch.randn(21, 96)
for codes, kind in ((GroupCodes.fit(torch.randn(37, 96), 4), Codes4Linear), (GroupCodes.fit(torch.randn(37, 96), 5), Codes5Linear),
                    (eight_bit_codes(37, 96), Codes8Linear)):
    exact = x @ codes.dequantize().t()
    layer = kind(codes, None, torch.float32, forms=ProductForms())  # dot products: these CPUs have no AMX
    print(kind.__name__, ((layer(x) - exact).norm() / exact.norm()).item())
x = torch.randn(21, 512)
for codes, name in ((random_q4_k(37, 512), "Q4_K"), (random_q5_k(37, 512), "Q5_K"), (random_q6_k(37, 512), "Q6_K")):
    exact = x @ codes.dequantize().t()
    kind = SubBlock6Linear if name == "Q6_K" else SuperBlockLinear
    print(name, ((kind(codes, None, torch.float32)(x) - exact).norm() / exact.norm()).item())
from engine.models.attention import grouped_attention
for dtype in (torch.float32, torch.bfloat16):  # head widths of 16 (8-float vectors) and 64 (16-float, pairs)
    for d in (16, 64):
        keys, values = (torch.randn(2, 2, 300, d).to(dtype) for _ in range(2))
        q = torch.randn(3, 6, 1, d).to(dtype)
        slots, positions = torch.tensor([1, 0, 1]), torch.tensor([[299], [7], [260]])
        got = torch.ops.kvserve.decode_attention(q, keys, values, slots, positions, 0).float()
        worst = max((got[r:r + 1] - grouped_attention(q[r:r + 1].float(), keys[slots[r], None, :, :positions[r, 0] + 1].float(),
                     values[slots[r], None, :, :positions[r, 0] + 1].float(), None)).abs().max().item() for r in range(3))
        print("attention-%s-%d" % (str(dtype)[6:], d), worst)
logits = torch.randn(3, 49157) * 5  # a vocabulary past whole vectors; -inf is a logit like any other
logits[1, 7] = float("-inf")
best, norm = torch.ops.kvserve.log_norm(logits)
print("log_norm", (norm.double() - logits.double().logsumexp(dim=-1)).abs().max().item())
print("best", int(torch.equal(best, logits.argmax(dim=-1)) and torch.equal(torch.ops.kvserve.first_max(logits), best)))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    errors = dict(line.split() for line in result.stdout.splitlines())
    assert float(errors["Codes4Linear"]) < 0.01 and float(errors["Codes5Linear"]) < 0.01 and float(errors["Codes8Linear"]) < 0.01
    assert all(float(errors[name]) < 0.01 for name in ("Q4_K", "Q5_K", "Q6_K"))
    assert float(errors["attention-float32-16"]) < 1e-5 and float(errors["attention-float32-64"]) < 1e-5
    assert float(errors["attention-bfloat16-16"]) < 1e-2 and float(errors["attention-bfloat16-64"]) < 1e-2
    assert float(errors["log_norm"]) < 1e-5 and errors["best"] == "1"


def test_without_a_compiler_our_kernels_say_why(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler")
    assert load_or_build().reason == "no C++ compiler"


def eight_bit_codes(out_features: int, in_features: int) -> GroupCodes:
    """Codes, scales and minimums exact in float16, as GGUF's blocks are (Q8_0's minimum is -128·scale; these add an
    offset, so that the kernels' handling of one is tested too)."""
    groups = (out_features, in_features // 32)
    scale = (torch.rand(groups) * 0.01 + 0.001).half().float()
    minimum = (torch.randn(groups) * 0.05 - 128 * scale).half().float()
    return GroupCodes(torch.randint(0, 256, (out_features, in_features), dtype=torch.uint8), scale, minimum, bits=8)


FORMS = {"dot": ProductForms(), "integer": ProductForms(integer_tiles_from=1), "bfloat16": ProductForms(bfloat16_tiles_from=1)}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("bits", [4, 5, 8])
@pytest.mark.parametrize("rows", [1, 2, 4, 7, 40])
def test_our_kernels_are_the_product_in_every_form(form, bits, rows):
    """Each form the kernels take (product_forms.py), forced at every row count: dot products and integer tiles
    with the inputs quantized to 8 bits per group; bfloat16 tiles with the weights and inputs rounded to bfloat16
    (40 rows: tiles of 16 input rows padded, an odd count of 16-row tiles of the weight)."""
    if load_kernels() is not None:
        pytest.skip(f"kvserve's kernels are off here: {load_kernels()}")
    if form != "dot" and not torch.ops.kvserve.tile_forms() & {"integer": INTEGER_TILES, "bfloat16": BFLOAT16_TILES}[form]:
        pytest.skip(f"this CPU or build has no {form} tiles")
    torch.manual_seed(0)
    # 37 outputs: the last tile padded. Scales and minimums exact in float16, as GGUF holds them.
    codes = eight_bit_codes(37, 96) if bits == 8 else fp16_exact(GroupCodes.fit(torch.randn(37, 96) * 0.05 + 0.02, bits))
    layer = codes_layer(bits)(codes, torch.randn(37), dtype=torch.float32, forms=FORMS[form])
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        got = layer(x) - layer.bias
        one_hot = layer(torch.eye(96)) - layer.bias  # every weight, in the same form
    exact = x @ codes.dequantize().t()
    assert got.shape == (rows, 37)
    # 8-bit inputs against centred codes: about 0.5% of the product, as llama.cpp's Q4 x Q8 and Q8 x Q8 products
    assert ((got - exact).norm() / exact.norm()).item() < 0.01
    # one-hot inputs give the weights themselves: exact, or rounded to bfloat16 (8 significant bits)
    tolerance = 2**-8 if form == "bfloat16" else 1e-5
    torch.testing.assert_close(one_hot, codes.dequantize().t(), atol=1e-5, rtol=tolerance)


def random_q4_k(out_features: int, in_features: int) -> SuperBlockCodes:
    """Q4_K codes of random bits: every code, 6-bit scale and minimum, float16 d and dmin of a plausible size."""
    generator = torch.Generator().manual_seed(0)
    groups, blocks = (out_features, in_features // 32), (out_features, in_features // 256)
    return SuperBlockCodes(torch.randint(0, 16, (out_features, in_features), dtype=torch.uint8, generator=generator),
                           torch.randint(0, 64, groups, dtype=torch.uint8, generator=generator),
                           torch.randint(0, 64, groups, dtype=torch.uint8, generator=generator),
                           (torch.rand(blocks, generator=generator) * 1e-3).half(),
                           (torch.rand(blocks, generator=generator) * 1e-3).half())


def random_q6_k(out_features: int, in_features: int) -> SubBlockCodes:
    """Q6_K codes of random bits: every code and int8 scale (of either sign), float16 d of a plausible size."""
    generator = torch.Generator().manual_seed(0)
    return SubBlockCodes(torch.randint(0, 64, (out_features, in_features), dtype=torch.uint8, generator=generator),
                         torch.randint(-128, 128, (out_features, in_features // 16), dtype=torch.int8, generator=generator),
                         (torch.rand(out_features, in_features // 256, generator=generator) * 1e-3).half())


def fp16_exact(codes: GroupCodes) -> GroupCodes:
    return GroupCodes(codes.codes, codes.scale.half().float(), codes.minimum.half().float(), codes.bits)


def random_q5_k(out_features: int, in_features: int) -> SuperBlockCodes:
    """Q5_K codes of random bits (Q4_K's scales, 5-bit codes)."""
    four = random_q4_k(out_features, in_features)
    codes = torch.randint(0, 32, four.codes.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    return SuperBlockCodes(codes, four.group_scale, four.group_minimum, four.scale, four.minimum_scale, bits=5)


@pytest.mark.parametrize("kind", ["4", "5", "8", "Q4_K", "Q5_K", "Q6_K"])
def test_our_kernels_run_inside_a_compiled_graph(kind):
    if load_kernels() is not None:
        pytest.skip(f"kvserve's kernels are off here: {load_kernels()}")
    torch.manual_seed(0)
    if kind == "Q4_K":
        layer = SuperBlockLinear(random_q4_k(64, 256), None, torch.float32)
    elif kind == "Q5_K":
        layer = SuperBlockLinear(random_q5_k(64, 256), None, torch.float32)
    elif kind == "Q6_K":
        layer = SubBlock6Linear(random_q6_k(64, 256), None, torch.float32)
    else:
        codes = eight_bit_codes(64, 64) if kind == "8" else GroupCodes.fit(torch.randn(64, 64), bits=int(kind))
        layer = codes_layer(int(kind))(codes, None, dtype=torch.float32)
    step = torch.compile(lambda v: torch.relu(layer(v)) * 2, fullgraph=True, dynamic=True)  # rows stay symbolic
    with torch.inference_mode():
        for rows in (2, 5):
            x = torch.randn(rows, layer.in_features)
            torch.testing.assert_close(step(x), torch.relu(layer(x)) * 2)


@pytest.mark.parametrize("kind", ["4", "4 centred", "5", "5 centred", "8 centred", "Q4_K", "Q5_K", "Q6_K"])
def test_each_layer_reads_its_rows_back_as_the_dequantized_codes(kind):
    """What a tied embedding looks up in the head's tiles: every row, bit for bit the codes' float32 weights (the
    values the dense table holds), in any order, from every position of a tile and from the padded last tile."""
    if kind in K_QUANTS:
        codes = {"Q4_K": random_q4_k, "Q5_K": random_q5_k, "Q6_K": random_q6_k}[kind](37, 512)
        layer = (SubBlock6Linear if kind == "Q6_K" else SuperBlockLinear)(codes, None, torch.float32)
    else:
        bits = int(kind.split()[0])
        generator = torch.Generator().manual_seed(bits)
        scale = (torch.rand(37, 16, generator=generator) * 0.01 + 0.001).half().float()
        minimum = -(2 ** (bits - 1)) * scale if "centred" in kind else (torch.randn(37, 16, generator=generator) * 0.01).half().float()
        codes = GroupCodes(torch.randint(0, 2 ** bits, (37, 512), dtype=torch.uint8, generator=generator), scale, minimum, bits)
        layer = codes_layer(bits)(codes, None, torch.float32)
    ids = torch.tensor([0, 5, 15, 16, 17, 36, 3, 3, 31, 32])
    assert torch.equal(layer.rows(ids), codes.dequantize()[ids])
    assert torch.equal(layer.rows(torch.arange(37)), codes.dequantize())


def test_four_bit_codes_fused_with_eight_bit_ones_keep_their_accuracy():
    """q, k in 4 bits beside v in 8 (as Q4_K_M files mix them) fuse into one 8-bit layer: the 4-bit weights exactly,
    and re-centred so that the 8-bit kernel's error stays that of 8-bit codes (not fifteen times a 4-bit one's)."""
    torch.manual_seed(0)
    four, eight = fp16_exact(GroupCodes.fit(torch.randn(32, 256) * 0.05, 4)), eight_bit_codes(16, 256)
    fused = GroupCodes.cat([four, eight])
    assert fused.bits == 8 and torch.equal(fused.dequantize()[:32], four.dequantize())
    if load_kernels() is not None:
        pytest.skip(f"kvserve's kernels are off here: {load_kernels()}")
    x = torch.randn(5, 256)
    with torch.inference_mode():
        got = codes_layer(8)(fused, None, torch.float32)(x)[:, :32]
    exact = x @ four.dequantize().t()
    assert ((got - exact).norm() / exact.norm()).item() < 0.01


def centred_codes(rows: int, bits: int, generator: torch.Generator) -> GroupCodes:
    """Random codes of `rows` rows of 256 inputs, w = s·(q − centre) as Q4_0, Q5_0 and Q8_0 store them."""
    scale = (torch.rand(rows, 8, generator=generator) * 0.01 + 0.001).half().float()
    return GroupCodes(torch.randint(0, 2 ** bits, (rows, 256), dtype=torch.uint8, generator=generator), scale,
                      -(2 ** (bits - 1)) * scale, bits)


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("bits", [4, 8])
def test_a_decode_steps_rows_get_the_bits_they_get_alone_in_every_form(form, bits):
    """Rows of one position each (b, 1, in), a decode step's, give each row the product it gets alone, whichever
    form the layer would take for that many rows (bfloat16 tiles round otherwise: they are not taken there)."""
    if load_kernels() is not None:
        pytest.skip(f"kvserve's kernels are off here: {load_kernels()}")
    generator = torch.Generator().manual_seed(bits)
    layer = codes_layer(bits)(centred_codes(48, bits, generator), None, torch.bfloat16, forms=FORMS[form])
    x = torch.randn(45, 1, 256, generator=generator).to(torch.bfloat16)  # whole passes of rows, then a rest of 5 or 1
    with torch.inference_mode():
        together = layer(x)  # (45, 1, 48)
        for row in (0, 17, 39, 44):
            assert torch.equal(together[row], layer(x[row: row + 1])[0])


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_rows_in_passes_get_the_bits_they_get_alone(kind):
    """The K-quants' dot products take the input rows in passes of a few (as even as they can be: 13 rows in passes
    of 5, 4 and 4, or 4, 4, 4 and 1), each row's sums its own: every row gets the bits it gets alone."""
    if load_kernels() is not None:
        pytest.skip(f"kvserve's kernels are off here: {load_kernels()}")
    codes = {"Q4_K": random_q4_k, "Q5_K": random_q5_k, "Q6_K": random_q6_k}[kind](37, 512)
    layer = (SubBlock6Linear if kind == "Q6_K" else SuperBlockLinear)(codes, None, torch.float32)
    x = torch.randn(13, 512, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        together = layer(x)
        for rows in (1, 5, 13):
            assert torch.equal(layer(x[:rows]), together[:rows])
        for row in (0, 4, 5, 12):
            assert torch.equal(together[row], layer(x[row: row + 1])[0])


@pytest.mark.parametrize("kind", ["Q4_0", "Q8_0", "Q4_K", "Q6_K"])
def test_every_tile_is_computed_once_whichever_thread_takes_it(kind):
    """A product's tiles are shared out over torch's threads, a thread done with its share taking the back half of
    another's (engine/linear/native/tile_shares.h): at any thread count, more threads than tiles or than cores
    among them, every output row is computed, and gets the bits one thread gives it."""
    if load_kernels() is not None:
        pytest.skip(f"kvserve's kernels are off here: {load_kernels()}")
    generator = torch.Generator().manual_seed(11)
    layers = []
    for out_features in (16 * 13 + 5, 16):  # 14 tiles, the last one part-filled; one tile
        if kind in ("Q4_0", "Q8_0"):
            bits = 4 if kind == "Q4_0" else 8
            layers.append(codes_layer(bits)(centred_codes(out_features, bits, generator), None, torch.float32))
        else:
            codes = {"Q4_K": random_q4_k, "Q6_K": random_q6_k}[kind](out_features, 256)
            layers.append((SubBlock6Linear if kind == "Q6_K" else SuperBlockLinear)(codes, None, torch.float32))
    x = torch.randn(3, 256, generator=generator)
    threads = torch.get_num_threads()
    try:
        with torch.inference_mode():
            for layer in layers:
                torch.set_num_threads(1)
                alone = layer(x)
                for count in (2, 3, 8, 2, 3, 8):
                    torch.set_num_threads(count)
                    assert torch.equal(layer(x), alone), (layer.out_features, count)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_rows_through_integer_tiles_get_the_bits_they_get_alone(kind):
    """Where the CPU has AMX, the K-quants take integer tiles for each whole 16 input rows (the rest dot products):
    the same integer sums in another order, so every row gets the bits it gets alone (a verification row or a
    batch's row decodes as a single stream does), and the products are the file's weights against 8-bit inputs."""
    if load_kernels() is not None:
        pytest.skip(f"kvserve's kernels are off here: {load_kernels()}")
    if not torch.ops.kvserve.tile_forms() & INTEGER_TILES:
        pytest.skip("this CPU or build has no integer tiles")
    codes = {"Q4_K": random_q4_k, "Q5_K": random_q5_k, "Q6_K": random_q6_k}[kind](37, 512)
    layer_class = SubBlock6Linear if kind == "Q6_K" else SuperBlockLinear
    tiled = layer_class(codes, None, torch.float32, forms=ProductForms(integer_tiles_from=1))
    dots = layer_class(codes, None, torch.float32)  # dot products at every row count
    x = torch.randn(40, 512, generator=torch.Generator().manual_seed(3))  # rows 0-31 in two tile passes, 32-39 not
    with torch.inference_mode():
        together = tiled(x)
        assert torch.equal(together, dots(x))
        for row in (0, 15, 16, 31, 32, 39):
            assert torch.equal(together[row], tiled(x[row: row + 1])[0])
        one_hot = tiled(torch.eye(512))  # 512 rows, all in tiles: every weight
    exact = x @ codes.dequantize().t()
    assert ((together - exact).norm() / exact.norm()).item() < 0.01
    torch.testing.assert_close(one_hot, codes.dequantize().t(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bits", [4, 5, 8])
def test_centred_codes_hold_no_minimums_and_compute_the_same(bits):
    """Q4_0, Q5_0 and Q8_0 are w = s·(q − centre): the layer holds no minimums (the file's 4.5, 5.5 and 8.5 bits per
    weight, not one more), and its products are bit for bit those with the minimums given."""
    if load_kernels() is not None:
        pytest.skip(f"kvserve's kernels are off here: {load_kernels()}")
    generator = torch.Generator().manual_seed(bits)
    codes = centred_codes(37, bits, generator)
    layer = codes_layer(bits)(codes, None, torch.float32)
    assert layer.minimum.numel() == 0
    x = torch.randn(5, 256, generator=generator)
    with torch.inference_mode():
        given = layer.kernel(x, layer.packed, layer.scale, -(2 ** (bits - 1)) * layer.scale, 37, 2**30, 2**30)
        assert torch.equal(layer.product(x), given)
        exact = x @ codes.dequantize().t()
        assert ((given - exact).norm() / exact.norm()).item() < 0.01
    offset = replace(codes, minimum=codes.minimum + codes.scale)  # Q4_1's kind: a minimum of its own
    assert codes_layer(bits)(offset, None, torch.float32).minimum.shape == layer.scale.shape


def test_parts_of_different_types_stack_each_as_stored():
    """q and k in Q4_K above v in Q6_K (as Q4_K_M files hold them), or Q4_0 beside Q8_0: fused, each run of one type
    stays as stored, and the stack's product is each part's own kernel's, side by side."""
    q, k, v = random_q4_k(32, 256), random_q4_k(16, 256), random_q6_k(16, 256)
    stack = fuse([q, k, v])
    assert isinstance(stack, StackedCodes) and [type(p) for p in stack.parts] == [SuperBlockCodes, SubBlockCodes]
    assert stack.shape == (64, 256) and torch.equal(stack.dequantize(), torch.cat([p.dequantize() for p in (q, k, v)]))
    four, eight = fp16_exact(GroupCodes.fit(torch.randn(32, 256) * 0.05, 4)), eight_bit_codes(16, 256)
    assert [p.bits for p in fuse([four, eight]).parts] == [4, 8]
    assert isinstance(fuse([q, k]), SuperBlockCodes)  # one type: one matrix, no stack
    if load_kernels() is not None:
        pytest.skip(f"kvserve's kernels are off here: {load_kernels()}")
    decision = Planner(Machine.found(torch.device("cpu")), "auto").plan(stack, None, Role("layers.0.self_attn.qkv_proj"))
    assert isinstance(decision.layer, StackedLinear)
    assert [type(p) for p in decision.layer.parts] == [SuperBlockLinear, SubBlock6Linear]
    x = torch.randn(3, 256)
    with torch.inference_mode():
        got = decision.layer(x)
        parts = [SuperBlockLinear(SuperBlockCodes.cat([q, k]), None, torch.bfloat16), SubBlock6Linear(v, None, torch.bfloat16)]
        assert torch.equal(got, torch.cat([p(x) for p in parts], dim=1))


def test_eight_bit_codes_are_two_exact_four_bit_halves():
    torch.manual_seed(0)
    codes = GroupCodes(torch.randint(0, 256, (16, 64), dtype=torch.uint8), torch.rand(16, 2) + 0.5,
                       torch.randn(16, 2), bits=8)
    rebuilt = sum(GroupCodes(q, s, m, bits=4).dequantize() for q, s, m in codes.halves())
    torch.testing.assert_close(rebuilt, codes.dequantize())


def test_fit_is_exact_for_weights_already_on_a_four_bit_grid():
    torch.manual_seed(0)
    codes = torch.randint(0, 16, (48, 2, 32)).float()
    codes[..., 0], codes[..., 1] = 0, 15  # every group spans all 16 levels, as a min/max quantizer sees it
    scale, low = torch.rand(48, 2, 1) * 0.1 + 0.01, torch.randn(48, 2, 1) * 0.1
    weight = (codes * scale + low).reshape(48, 64)
    torch.testing.assert_close(GroupCodes.fit(weight, 4).dequantize(), weight, atol=1e-6, rtol=1e-5)


def test_stacking_widens_four_bit_parts_exactly():
    torch.manual_seed(0)
    four = GroupCodes.fit(torch.randn(8, 64), 4)
    eight = GroupCodes.fit(torch.randn(4, 64), 8)
    both = GroupCodes.cat([four, eight])
    assert both.bits == 8
    torch.testing.assert_close(both.dequantize(), torch.cat([four.dequantize(), eight.dequantize()]))


def test_int8_is_exact_for_weights_on_a_per_row_grid():
    torch.manual_seed(0)
    codes = torch.randint(-127, 128, (48, 64)).float()
    codes[:, 0] = 127  # every row reaches the top code, as an absmax quantizer sees it
    weight, bias = codes * (torch.rand(48, 1) * 0.01 + 0.001), torch.randn(48)
    x = torch.randn(5, 64)
    with torch.inference_mode():
        got = Int8Linear(weight, bias, dtype=torch.float32)(x)
    torch.testing.assert_close(got, x @ weight.t() + bias, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_quantized_engine_stays_close_to_dense(tiny_dir, kind):
    layer = codes_layer(4) if kind == "int4" else Int8Linear
    settings = dict(device="cpu", max_batch_size=2, max_seq_len=128)
    dense = load_engine(tiny_dir, EngineConfig(dtype="bfloat16", **settings))
    quantized = load_engine(tiny_dir, EngineConfig(quantize=kind, **settings))
    assert not dense.quantized and quantized.quantized and quantized.dtype == torch.bfloat16
    assert isinstance(quantized.model.layers[0].mlp.down_proj, layer) and isinstance(quantized.model.lm_head, Int8Linear)
    assert quantized.weights_bytes < dense.weights_bytes
    ids = quantized.tokenizer.encode("The quick brown fox jumps over the lazy dog")
    a, b = dense.prompt_logits(ids), quantized.prompt_logits(ids)
    # 4-bit weights move logits a little; the distribution over next tokens stays nearly the same.
    kl = torch.nn.functional.kl_div(b.log_softmax(-1), a.log_softmax(-1), log_target=True, reduction="batchmean")
    assert kl.item() < 0.05
    (completion,) = quantized.generate([ids], SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True))
    assert len(completion.output_ids) == 8


def test_auto_keeps_float_checkpoints_dense(tiny_dir):
    engine = load_engine(tiny_dir, EngineConfig(device="cpu", max_batch_size=1, max_seq_len=64))
    assert not engine.quantized


def test_quantizing_refuses_float32_and_unknown_schemes():
    with pytest.raises(ValueError, match="computes in bfloat16"):
        EngineConfig(quantize="int4", dtype="float32")
    with pytest.raises(ValueError, match="quantize must be one of auto, none, int4, int8"):
        EngineConfig(quantize="int3")


def test_each_tile_form_runs_from_where_it_wins_at_every_larger_count():
    timings = {1: {"dot": 1, "integer": 2, "bfloat16": 5}, 8: {"dot": 4, "integer": 3, "bfloat16": 6},
               16: {"dot": 8, "integer": 5, "bfloat16": 7}, 32: {"dot": 9, "integer": 6, "bfloat16": 9},
               64: {"dot": 20, "integer": 12, "bfloat16": 10}, 128: {"dot": 40, "integer": 24, "bfloat16": 15}}
    assert crossovers(timings) == ProductForms(integer_tiles_from=8, bfloat16_tiles_from=64)
    timings[32]["bfloat16"] = 5  # a win that a larger count does not keep up would not start the form
    timings[64]["bfloat16"] = 13
    assert crossovers(timings) == ProductForms(integer_tiles_from=8, bfloat16_tiles_from=128)
    without_tiles = {rows: {"dot": forms["dot"]} for rows, forms in timings.items()}
    assert crossovers(without_tiles) == ProductForms()


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("rows", [5, 32])
def test_our_kernels_take_bfloat16_rows_as_the_same_values_in_float32(form, rows):
    """A model computing in bfloat16 hands its rows over as they are (32 rows: whole tiles of input rows, which
    the bfloat16 form reads in place)."""
    if load_kernels() is not None:
        pytest.skip(f"kvserve's kernels are off here: {load_kernels()}")
    if form != "dot" and not torch.ops.kvserve.tile_forms() & {"integer": INTEGER_TILES, "bfloat16": BFLOAT16_TILES}[form]:
        pytest.skip(f"this CPU or build has no {form} tiles")
    torch.manual_seed(0)
    layer = codes_layer(4)(GroupCodes.fit(torch.randn(37, 96), 4), None, dtype=torch.float32, forms=FORMS[form])
    x = torch.randn(rows, 96).bfloat16()
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), layer(x.float()), atol=0, rtol=0)
