// rows (m, in) float32 or bfloat16 · W(out, in)ᵀ -> (m, out) float32, W held as GGUF's Q4_K or Q5_K super-blocks, as
// stored: per 256 inputs of a row, float16 d and dmin; per group of 32 inputs, 6-bit sc and mn; per input a 4-bit
// (Q4_K) or 5-bit (Q5_K) code q; w = d·sc·q − dmin·mn.
//
// The products are llama.cpp's for these types (super_block.h): per super-block and output row,
//   Σ w·x ≈ d·e·Σ_g sc_g·Σ q·x̂ − dmin·e·Σ_g mn_g·Σ x̂,   x ≈ e·x̂ (8-bit inputs, one scale e per 256),
// the sums in integers: Σ q·x̂ per group as the group codes' products take it (vpmaddubsw pairs in int16, or
// vpdpbusd), times sc by vpmaddwd (or a 32-bit multiply), mn·Σ x̂ two groups per vpmaddwd.
// Bounds: a group's Σ q·x̂ <= 32·31·127 and sc, mn < 64, so a super-block's sums stay far inside int32.
//
// Layout (made by engine/linear/quantized.py): the codes packed as codes4_product.cpp and codes5_product.cpp pack them
// (tiles of 16 output rows, 256 or 320 bytes per tile and group); group_scale and group_minimum: uint8 (tiles, groups,
// 16); scale and minimum_scale: float16 (tiles, groups / 8, 16). 4.625 bits per weight against the file's 4.5: sc and
// mn take a byte each rather than 6 bits, so that a group's are one load.
#include <torch/library.h>

#include "super_block.h"

namespace kvserve {
namespace {

// superblock_tile's Format: sums[r][0] = Σ_g sc_g·Σ q·x̂, sums[r][1] = Σ_g mn_g·Σ x̂ over a super-block.
template <typename CodesT>
struct SuperBlockFormat {
  using Codes = CodesT;
  static constexpr int kSums = 2;
  const uint8_t* packed;
  const uint8_t* sc;
  const uint8_t* mn;
  const at::Half* d;
  const at::Half* dmin;
  int64_t groups;

  template <int R>
  void add(int64_t t, int64_t g, int part, const Operand (&w)[8], const QuantizedSuperBlocks& x, int64_t row,
           Sums (&sums)[R][kSums]) const {
    const uint8_t* scg = sc + (t * groups + g) * kTile;
    const int64_t in = groups * kGroup;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    const __m512i s = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scg)));
    for (int r = 0; r < R; ++r) {
      const int8_t* xq = x.codes.data() + (row + r) * in + g * kGroup;
      const __m512i dot = group_dots<R>(_mm512_setzero_si512(), w, xq);  // Σ q·x̂
      sums[r][0] = _mm512_add_epi32(sums[r][0], _mm512_mullo_epi32(dot, s));
    }
#else
    const __m128i s8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(scg + kPartRows * part));
    const __m256i s = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(s8, s8));  // sc twice per row, as int16
    for (int r = 0; r < R; ++r)
      sums[r][0] = _mm256_add_epi32(sums[r][0], pair_sums<Codes>(w, x.codes.data() + (row + r) * in + g * kGroup, s));
#endif
  }

  // The minimums' sums two groups at a time, (mn_g, mn_g+1) against (Σ x̂_g, Σ x̂_g+1) by one vpmaddwd per row,
  // then acc += d·e·sums[0] − dmin·e·sums[1].
  template <int R>
  void fold(int64_t t, int64_t b, int part, const QuantizedSuperBlocks& x, int64_t row, Sums (&sums)[R][kSums],
            Floats (&acc)[R]) const {
    const int64_t blocks = groups / kSuperBlockGroups, lanes = (t * blocks + b) * kTile + kPartRows * part;
    for (int64_t g = b * kSuperBlockGroups; g < (b + 1) * kSuperBlockGroups; g += 2) {
      const uint8_t* mng = mn + (t * groups + g) * kTile + kPartRows * part;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
      const __m128i m0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(mng));
      const __m128i m1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(mng + kTile));
      const __m512i m = _mm512_cvtepu8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(m0, m1), _mm_unpacklo_epi8(m0, m1)));
      for (int r = 0; r < R; ++r)
        sums[r][1] = _mm512_add_epi32(sums[r][1], _mm512_madd_epi16(m, _mm512_set1_epi32(
                                                      QuantizedSuperBlocks::pair(x.group_sum.data() + (row + r) * groups + g))));
#else
      const __m128i m0 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(mng));
      const __m128i m1 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(mng + kTile));
      const __m256i m = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m0, m1));  // (mn_g, mn_g+1) per row
      for (int r = 0; r < R; ++r)
        sums[r][1] = _mm256_add_epi32(sums[r][1], _mm256_madd_epi16(m, _mm256_set1_epi32(
                                                      QuantizedSuperBlocks::pair(x.group_sum.data() + (row + r) * groups + g))));
#endif
    }
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + lanes)));
    const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dmin + lanes)));
    for (int r = 0; r < R; ++r) {
      const __m512 e = _mm512_set1_ps(x.scale[(row + r) * blocks + b]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r][0]), _mm512_mul_ps(dv, e), acc[r]);
      acc[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(sums[r][1]), _mm512_mul_ps(mv, e), acc[r]);
    }
#else
    const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + lanes)));
    const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dmin + lanes)));
    for (int r = 0; r < R; ++r) {
      const __m256 e = _mm256_set1_ps(x.scale[(row + r) * blocks + b]);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r][0]), _mm256_mul_ps(dv, e), acc[r]);
      acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(sums[r][1]), _mm256_mul_ps(mv, e), acc[r]);
    }
#endif
  }

#ifdef KVSERVE_AMX
  // superblock_tile_amx's: per group of super-block b one tdpbsud gives the 16 rows' Σ q·x̂ (the integers `add` takes
  // by vpdpbusd), times sc and summed in int32 as `add` sums them.
  static TileConfig tile_config() { return TileConfig(kAmxRows); }

  void tile_sums(int64_t t, int64_t b, const QuantizedSuperBlocks& x, int64_t row, Sums (&sums)[kAmxRows][kSums]) const {
    const int64_t in = groups * kGroup;
    const uint8_t* codes = packed + t * groups * Codes::kTileGroupBytes;
    alignas(64) uint8_t weights[kAmxGroups][8 * 64];
    alignas(64) int32_t dots[kAmxGroups][kAmxRows * kTile];
    static_assert(kSuperBlockGroups % kAmxGroups == 0, "a super-block is whole passes of tile products");
    for (int64_t g0 = b * kSuperBlockGroups; g0 < (b + 1) * kSuperBlockGroups; g0 += kAmxGroups) {
      amx_dots<Codes>(codes, x.codes.data() + row * in, in, g0, kAmxGroups, weights, dots);
      for (int i = 0; i < kAmxGroups; ++i) {
        const __m512i s = _mm512_cvtepu8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + (t * groups + g0 + i) * kTile)));
        for (int r = 0; r < kAmxRows; ++r)
          sums[r][0] = _mm512_add_epi32(sums[r][0], _mm512_mullo_epi32(_mm512_load_si512(dots[i] + r * kTile), s));
      }
    }
  }
#endif
};

template <typename Codes>
at::Tensor superblock_product(const at::Tensor& rows, const at::Tensor& packed, const at::Tensor& group_scale,
                              const at::Tensor& group_minimum, const at::Tensor& scale,
                              const at::Tensor& minimum_scale, int64_t out_features, int64_t integer_tiles_from) {
  const int64_t groups = rows.size(1) / kGroup, tiles = packed.size(0);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(1) == groups * Codes::kTileGroupBytes, "packed: contiguous uint8 (tiles, groups · tile bytes)");
  TORCH_CHECK(group_scale.scalar_type() == at::kByte && group_minimum.scalar_type() == at::kByte &&
                  group_scale.is_contiguous() && group_minimum.is_contiguous() &&
                  group_scale.numel() == tiles * groups * kTile && group_minimum.sizes() == group_scale.sizes(),
              "group_scale and group_minimum: contiguous uint8 (tiles, in / 32, 16)");
  TORCH_CHECK(scale.scalar_type() == at::kHalf && minimum_scale.scalar_type() == at::kHalf && scale.is_contiguous() &&
                  minimum_scale.is_contiguous() && scale.numel() == tiles * (groups / kSuperBlockGroups) * kTile &&
                  minimum_scale.sizes() == scale.sizes(),
              "scale and minimum_scale: contiguous float16 (tiles, in / 256, 16)");
  const SuperBlockFormat<Codes> format{packed.data_ptr<uint8_t>(), group_scale.data_ptr<uint8_t>(),
                                       group_minimum.data_ptr<uint8_t>(), scale.data_ptr<at::Half>(),
                                       minimum_scale.data_ptr<at::Half>(), groups};
  return superblock_products(rows, tiles, out_features, format, integer_tiles_from);
}

at::Tensor superblock_product_meta(const at::Tensor& rows, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   const at::Tensor&, const at::Tensor&, int64_t out_features, int64_t) {
  return superblock_products_meta(rows, out_features);
}

}  // namespace
}  // namespace kvserve

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("superblock4_product(Tensor rows, Tensor packed, Tensor group_scale, Tensor group_minimum, Tensor scale, "
        "Tensor minimum_scale, int out_features, int integer_tiles_from) -> Tensor");
  m.def("superblock5_product(Tensor rows, Tensor packed, Tensor group_scale, Tensor group_minimum, Tensor scale, "
        "Tensor minimum_scale, int out_features, int integer_tiles_from) -> Tensor");
}
TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("superblock4_product", &kvserve::superblock_product<kvserve::Codes4Tile>);
  m.impl("superblock5_product", &kvserve::superblock_product<kvserve::Codes5Tile>);
}
TORCH_LIBRARY_IMPL(kvserve, Meta, m) {
  m.impl("superblock4_product", &kvserve::superblock_product_meta);
  m.impl("superblock5_product", &kvserve::superblock_product_meta);
}
