// rows (m, in) float32 or bfloat16 · W(out, in)ᵀ -> (m, out) float32, W held as 4-bit group codes (GGUF's Q4_0 and Q4_1 blocks):
// w[o, i] = scale[o, g]·codes[o, i] + minimum[o, g], g = i / 32, codes in [0, 16).
//
// The products are integer dot products, as llama.cpp computes them: each row's group of 32 inputs is
// quantized to 8 bits (x ≈ d·x̂, d = max|x| / 127), and 16 output rows at once take Σ codes·x̂ in 32-bit
// integers (AVX512-VNNI's vpdpbusd, or AVX2's vpmaddubsw + vpmaddwd; with AMX, from a few input rows, AMX's tdpbsud
// of up to 16 input rows per group, and for many rows bfloat16 tiles: group_product.h). The codes are centred on 8 before
// their product with the rounding error of x̂ (Σ (q - 8)·x̂ = Σ q·x̂ - 8·Σ x̂), and the rest of each weight
// (minimum + 8·scale) meets the exact Σ x: the error is that of centred 4-bit weights times 8-bit inputs.
//
// Layout (`packed`, made by engine/linear/quantized.py): tiles of 16 output rows; per tile and group, 256 bytes
// in four runs of 64; run k holds, for row j at bytes 4j..4j+3, inputs 8k..8k+3 in the low nibbles and
// 8k+4..8k+7 in the high ones. One 64-byte run masked or shifted is one vpdpbusd operand for 16 rows, whose
// other operand is 4 input codes broadcast. scale and minimum: float16 (tiles, groups, 16).
#include <torch/library.h>

#include "group_product.h"

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("tile_forms() -> int", &kvserve::tile_forms);  // bits: 1 integer tiles, 2 bfloat16 tiles (group_product.h)
  m.def("codes4_product(Tensor rows, Tensor packed, Tensor scale, Tensor minimum, int out_features, "
        "int integer_tiles_from, int bfloat16_tiles_from) -> Tensor");
}
TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("codes4_product", &kvserve::group_product<kvserve::Codes4Tile>); }
TORCH_LIBRARY_IMPL(kvserve, Meta, m) { m.impl("codes4_product", &kvserve::group_product_meta); }
