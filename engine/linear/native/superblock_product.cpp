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

template <typename Codes>
struct SuperBlockFormat {
  const uint8_t* packed;
  const uint8_t* sc;
  const uint8_t* mn;
  const at::Half* d;
  const at::Half* dmin;
  int64_t groups;

  template <int R>
  void run(int64_t t, const QuantizedSuperBlocks& x, int64_t row, float* y, int64_t out) const {
    const int64_t blocks = groups / kSuperBlockGroups, in = groups * kGroup;
    const uint8_t* codes = packed + t * groups * Codes::kTileGroupBytes;
    const uint8_t* sct = sc + t * groups * kTile;
    const uint8_t* mnt = mn + t * groups * kTile;
    const at::Half* dt = d + t * blocks * kTile;
    const at::Half* dmint = dmin + t * blocks * kTile;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      __m512i dot[R], mins[R];
      for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512(), mins[r] = _mm512_setzero_si512();
      for (int64_t g = b * kSuperBlockGroups; g < (b + 1) * kSuperBlockGroups; ++g) {
        prefetch(codes + g * Codes::kTileGroupBytes + kPrefetchBytes, Codes::kTileGroupBytes);
        Operand w[8];
        Codes::operands(codes + g * Codes::kTileGroupBytes, 0, w);
        const __m512i s = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sct + g * kTile)));
        for (int r = 0; r < R; ++r) {
          const int8_t* xq = x.codes.data() + (row + r) * in + g * kGroup;
          __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();  // two chains: half the latency
          for (int k = 0; k < 8; k += 2) {
            even = _mm512_dpbusd_epi32(even, w[k], _mm512_set1_epi32(four_codes(xq + 4 * k)));
            odd = _mm512_dpbusd_epi32(odd, w[k + 1], _mm512_set1_epi32(four_codes(xq + 4 * k + 4)));
          }
          dot[r] = _mm512_add_epi32(dot[r], _mm512_mullo_epi32(_mm512_add_epi32(even, odd), s));
        }
      }
      for (int64_t g = b * kSuperBlockGroups; g < (b + 1) * kSuperBlockGroups; g += 2) {
        // (mn_g, mn_g+1) as two int16 per row, against (Σ x̂_g, Σ x̂_g+1)
        const __m128i m0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(mnt + g * kTile));
        const __m128i m1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(mnt + (g + 1) * kTile));
        const __m512i m = _mm512_cvtepu8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(m0, m1), _mm_unpacklo_epi8(m0, m1)));
        for (int r = 0; r < R; ++r)
          mins[r] = _mm512_add_epi32(mins[r], _mm512_madd_epi16(m, _mm512_set1_epi32(
                                                  QuantizedSuperBlocks::pair(x.group_sum.data() + (row + r) * groups + g))));
      }
      const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dt + b * kTile)));
      const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dmint + b * kTile)));
      for (int r = 0; r < R; ++r) {
        const __m512 e = _mm512_set1_ps(x.scale[(row + r) * blocks + b]);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(dv, e), acc[r]);
        acc[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mins[r]), _mm512_mul_ps(mv, e), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * out, acc[r]);
#else
    __m256 acc[kParts][R];
    for (int part = 0; part < kParts; ++part)
      for (int r = 0; r < R; ++r) acc[part][r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      for (int part = 0; part < kParts; ++part) {  // both parts of a super-block while its lines are in cache
        __m256i dot[R], mins[R];
        for (int r = 0; r < R; ++r) dot[r] = _mm256_setzero_si256(), mins[r] = _mm256_setzero_si256();
        for (int64_t g = b * kSuperBlockGroups; g < (b + 1) * kSuperBlockGroups; ++g) {
          if (part == 0) prefetch(codes + g * Codes::kTileGroupBytes + kPrefetchBytes, Codes::kTileGroupBytes);
          Operand w[8];
          Codes::operands(codes + g * Codes::kTileGroupBytes, part, w);
          const __m128i s8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sct + g * kTile + 8 * part));
          const __m256i s = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(s8, s8));  // sc twice per row, as int16
          for (int r = 0; r < R; ++r)
            dot[r] = _mm256_add_epi32(dot[r], pair_sums<Codes>(w, x.codes.data() + (row + r) * in + g * kGroup, s));
        }
        for (int64_t g = b * kSuperBlockGroups; g < (b + 1) * kSuperBlockGroups; g += 2) {
          const __m128i m0 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(mnt + g * kTile + 8 * part));
          const __m128i m1 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(mnt + (g + 1) * kTile + 8 * part));
          const __m256i m = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m0, m1));  // (mn_g, mn_g+1) per row
          for (int r = 0; r < R; ++r)
            mins[r] = _mm256_add_epi32(mins[r], _mm256_madd_epi16(m, _mm256_set1_epi32(
                                                    QuantizedSuperBlocks::pair(x.group_sum.data() + (row + r) * groups + g))));
        }
        const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dt + b * kTile + 8 * part)));
        const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dmint + b * kTile + 8 * part)));
        for (int r = 0; r < R; ++r) {
          const __m256 e = _mm256_set1_ps(x.scale[(row + r) * blocks + b]);
          acc[part][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), _mm256_mul_ps(dv, e), acc[part][r]);
          acc[part][r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mins[r]), _mm256_mul_ps(mv, e), acc[part][r]);
        }
      }
    }
    for (int part = 0; part < kParts; ++part)
      for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * out + 8 * part, acc[part][r]);
#endif
  }
};

template <typename Codes>
at::Tensor superblock_product(const at::Tensor& rows, const at::Tensor& packed, const at::Tensor& group_scale,
                              const at::Tensor& group_minimum, const at::Tensor& scale,
                              const at::Tensor& minimum_scale, int64_t out_features) {
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
  return superblock_products(rows, tiles, out_features, format);
}

at::Tensor superblock_product_meta(const at::Tensor& rows, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   const at::Tensor&, const at::Tensor&, int64_t out_features) {
  return superblock_products_meta(rows, out_features);
}

}  // namespace
}  // namespace kvserve

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("superblock4_product(Tensor rows, Tensor packed, Tensor group_scale, Tensor group_minimum, Tensor scale, "
        "Tensor minimum_scale, int out_features) -> Tensor");
  m.def("superblock5_product(Tensor rows, Tensor packed, Tensor group_scale, Tensor group_minimum, Tensor scale, "
        "Tensor minimum_scale, int out_features) -> Tensor");
}
TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("superblock4_product", &kvserve::superblock_product<kvserve::Codes4Tile>);
  m.impl("superblock5_product", &kvserve::superblock_product<kvserve::Codes5Tile>);
}
TORCH_LIBRARY_IMPL(kvserve, Meta, m) {
  m.impl("superblock4_product", &kvserve::superblock_product_meta);
  m.impl("superblock5_product", &kvserve::superblock_product_meta);
}
