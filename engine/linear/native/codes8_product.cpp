// rows (m, in) float32 or bfloat16 · W(out, in)ᵀ -> (m, out) float32, W held as 8-bit group codes (GGUF's Q8_0 blocks):
// w[o, i] = scale[o, g]·codes[o, i] + minimum[o, g], g = i / 32, codes in [0, 256).
//
// As codes4_product.cpp, integer dot products of 16 output rows at once against the inputs quantized to 8 bits
// per group of 32, with the codes centred on 128 (Σ (q - 128)·x̂ = Σ q·x̂ - 128·Σ x̂) and the rest of each
// weight, minimum + 128·scale (zero for Q8_0, whose blocks are d·(q - 128)), meeting the exact Σ x.
// AVX512-VNNI: vpdpbusd of the unsigned codes and the signed inputs (AMX: tdpbsud, or bfloat16 tiles for many
// rows: group_product.h). AVX2: vpmaddubsw of |q - 128| and the
// inputs carrying its sign (|q - 128| <= 128 and |x̂| <= 127, so a pair's sum fits in int16), then vpmaddwd.
//
// Layout (`packed`, made by engine/linear/quantized.py): tiles of 16 output rows; per tile and group, 512 bytes in
// eight runs of 64; run k holds, for row j at bytes 4j..4j+3, the codes of inputs 4k..4k+3. scale and minimum:
// float16 (tiles, groups, 16).
#include <torch/library.h>

#include "group_product.h"

namespace kvserve {
namespace {

struct Codes8Tile {
  static constexpr int64_t kTileGroupBytes = kTile * kGroup;
  static constexpr int32_t kCentre = 128;
  static constexpr int kInt16Terms = 0;  // 2·255·127 saturates int16: group_dot takes signs instead

  static void operands(const uint8_t* bytes, int part, Operand (&w)[8]) {
    for (int k = 0; k < 8; ++k)
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
      w[k] = _mm512_loadu_si512(bytes + 64 * k);
#else
      w[k] = _mm256_loadu_si256(reinterpret_cast<const Operand*>(bytes + 64 * k + 32 * part));
#endif
  }
};

}  // namespace
}  // namespace kvserve

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("codes8_product(Tensor rows, Tensor packed, Tensor scale, Tensor minimum, int out_features, "
        "int integer_tiles_from, int bfloat16_tiles_from) -> Tensor");
}
TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("codes8_product", &kvserve::group_product<kvserve::Codes8Tile>); }
TORCH_LIBRARY_IMPL(kvserve, Meta, m) { m.impl("codes8_product", &kvserve::group_product_meta); }
