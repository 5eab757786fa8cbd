// rows (m, in) float32 or bfloat16 · W(out, in)ᵀ -> (m, out) float32, W held as 5-bit group codes (GGUF's Q5_0 and Q5_1
// blocks): w[o, i] = scale[o, g]·codes[o, i] + minimum[o, g], g = i / 32, codes in [0, 32).
//
// The products are codes4_product.cpp's (group_product.h), the codes centred on 16; the layout is Codes5Tile's:
// Codes4Tile's 256 bytes of low nibbles per tile and group, then 64 bytes of fifth bits. scale and minimum: float16
// (tiles, groups, 16).
#include <torch/library.h>

#include "group_product.h"

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("codes5_product(Tensor rows, Tensor packed, Tensor scale, Tensor minimum, int out_features, "
        "int integer_tiles_from, int bfloat16_tiles_from) -> Tensor");
}
TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("codes5_product", &kvserve::group_product<kvserve::Codes5Tile>); }
TORCH_LIBRARY_IMPL(kvserve, Meta, m) { m.impl("codes5_product", &kvserve::group_product_meta); }
