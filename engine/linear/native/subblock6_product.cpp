// rows (m, in) float32 or bfloat16 · W(out, in)ᵀ -> (m, out) float32, W held as GGUF's Q6_K super-blocks, as stored:
// per 256 inputs of a row a float16 d, per 16 inputs an int8 scale sc, per input a 6-bit code q; w = d·sc·(q − 32).
//
// The products are integer dot products against the inputs quantized to 8 bits per group of 32 (group_product.h's
// QuantizedRows), as for Q4_0: per group and output row, the two halves' Σ q·x̂ (vpdpbusd, or AVX2's vpmaddubsw:
// q <= 63 and |x̂| <= 127, so a pair's sum fits in int16) less 32·Σ x̂ of the half, times the half's sc, summed in
// int32, then scaled by d and the group's input scale. Nothing is rounded but x̂: w·x̂ is exact in the integers.
//
// Layout (made by engine/linear/quantized.py): tiles of 16 output rows; per tile and group, 384 bytes: the codes'
// low 4 bits as codes4_product.cpp packs 4-bit codes (256 bytes, four runs of 64), then their high 2 bits in four
// runs of 32: byte b of run k holds, in its low nibble, the high bits of run k's byte b (bits 0-1: its low nibble's
// input, 2-3: its high nibble's) and in its high nibble those of byte b + 32. scale: int8 (tiles, groups, 2, 16),
// each half's sc per row; d: float16 (tiles, groups / 8, 16).
#include <torch/library.h>

#include "group_product.h"

namespace kvserve {
namespace {

struct Codes6Tile {
  static constexpr int64_t kTileGroupBytes = kTile * kGroup / 2 + kTile * kGroup / 4;
  static constexpr int32_t kCentre = 32;

  // As Codes4Tile's operands, each byte completed by its two high bits: w[2k] inputs 8k..8k+3, w[2k+1] 8k+4..8k+7.
  static void operands(const uint8_t* bytes, int part, Operand (&w)[8]) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    const Operand nibble = _mm512_set1_epi8(0x0F), two = _mm512_set1_epi8(0x03), upper_two = _mm512_set1_epi8(0x0C);
    for (int k = 0; k < 4; ++k) {
      const Operand run = _mm512_loadu_si512(bytes + 64 * k);
      const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + 256 + 32 * k));
      const Operand high = _mm512_and_si512(nibble, _mm512_inserti64x4(_mm512_castsi256_si512(packed),
                                                                        _mm256_srli_epi16(packed, 4), 1));
      w[2 * k] = _mm512_or_si512(_mm512_and_si512(run, nibble), _mm512_slli_epi16(_mm512_and_si512(high, two), 4));
      w[2 * k + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(run, 4), nibble),
                                     _mm512_slli_epi16(_mm512_and_si512(high, upper_two), 2));
    }
#else
    const Operand nibble = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(0x03), upper_two = _mm256_set1_epi8(0x0C);
    for (int k = 0; k < 4; ++k) {
      const Operand run = _mm256_loadu_si256(reinterpret_cast<const Operand*>(bytes + 64 * k + 32 * part));
      const Operand packed = _mm256_loadu_si256(reinterpret_cast<const Operand*>(bytes + 256 + 32 * k));
      const Operand high = _mm256_and_si256(part ? _mm256_srli_epi16(packed, 4) : packed, nibble);
      w[2 * k] = _mm256_or_si256(_mm256_and_si256(run, nibble), _mm256_slli_epi16(_mm256_and_si256(high, two), 4));
      w[2 * k + 1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(run, 4), nibble),
                                     _mm256_slli_epi16(_mm256_and_si256(high, upper_two), 2));
    }
#endif
  }
};

// One part of a tile, R input rows from `row`: y[r·out + lanes] = the product.
template <int R>
void run_tile6(const uint8_t* packed, const int8_t* scale, const at::Half* d, int64_t groups, const QuantizedRows& x,
               int64_t row, int64_t in, float* y, int64_t out) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  {  // one part: all 16 rows
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      Operand w[8];
      Codes6Tile::operands(packed + g * Codes6Tile::kTileGroupBytes, 0, w);
      const __m512i sc0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scale + 2 * g * kTile)));
      const __m512i sc1 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scale + (2 * g + 1) * kTile)));
      const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + g / kSuperBlockGroups * kTile)));
      for (int r = 0; r < R; ++r) {
        const int64_t rg = (row + r) * groups + g;
        const int8_t* codes = x.codes.data() + (row + r) * in + g * kGroup;
        __m512i low = _mm512_setzero_si512(), high = _mm512_setzero_si512();
        for (int k = 0; k < 4; ++k) {
          low = _mm512_dpbusd_epi32(low, w[k], _mm512_set1_epi32(four_codes(codes + 4 * k)));
          high = _mm512_dpbusd_epi32(high, w[k + 4], _mm512_set1_epi32(four_codes(codes + 16 + 4 * k)));
        }
        low = _mm512_sub_epi32(low, _mm512_set1_epi32(Codes6Tile::kCentre * x.half_sum[2 * rg]));
        high = _mm512_sub_epi32(high, _mm512_set1_epi32(Codes6Tile::kCentre * x.half_sum[2 * rg + 1]));
        const __m512i total = _mm512_add_epi32(_mm512_mullo_epi32(low, sc0), _mm512_mullo_epi32(high, sc1));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(dv, _mm512_set1_ps(x.scale[rg])), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * out, acc[r]);
  }
#else
  for (int part = 0; part < kParts; ++part) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      Operand w[8];
      Codes6Tile::operands(packed + g * Codes6Tile::kTileGroupBytes, part, w);
      const int64_t lanes = 8 * part;
      const __m256i sc0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(scale + 2 * g * kTile + lanes)));
      const __m256i sc1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(scale + (2 * g + 1) * kTile + lanes)));
      const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + g / kSuperBlockGroups * kTile + lanes)));
      for (int r = 0; r < R; ++r) {
        const int64_t rg = (row + r) * groups + g;
        const int8_t* codes = x.codes.data() + (row + r) * in + g * kGroup;
        // unsigned codes · signed inputs: two vpmaddubsw pairs add up in int16 (2 · 2·63·127 < 2^15), then in int32
        const auto dots = [&](int k) {
          return _mm256_madd_epi16(_mm256_add_epi16(
              _mm256_maddubs_epi16(w[k], _mm256_set1_epi32(four_codes(codes + 4 * k))),
              _mm256_maddubs_epi16(w[k + 1], _mm256_set1_epi32(four_codes(codes + 4 * k + 4)))), _mm256_set1_epi16(1));
        };
        __m256i low = _mm256_add_epi32(dots(0), dots(2)), high = _mm256_add_epi32(dots(4), dots(6));
        low = _mm256_sub_epi32(low, _mm256_set1_epi32(Codes6Tile::kCentre * x.half_sum[2 * rg]));
        high = _mm256_sub_epi32(high, _mm256_set1_epi32(Codes6Tile::kCentre * x.half_sum[2 * rg + 1]));
        const __m256i total = _mm256_add_epi32(_mm256_mullo_epi32(low, sc0), _mm256_mullo_epi32(high, sc1));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(dv, _mm256_set1_ps(x.scale[rg])), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * out + 8 * part, acc[r]);
  }
#endif
}

at::Tensor subblock6_product(const at::Tensor& rows, const at::Tensor& packed, const at::Tensor& scale,
                             const at::Tensor& d, int64_t out_features) {
  TORCH_CHECK(rows.dim() == 2 && (rows.scalar_type() == at::kFloat || rows.scalar_type() == at::kBFloat16) &&
                  rows.is_contiguous(), "rows: contiguous float32 or bfloat16 (m, in)");
  const int64_t m = rows.size(0), in = rows.size(1), groups = in / kGroup, tiles = packed.size(0);
  TORCH_CHECK(in % (kGroup * kSuperBlockGroups) == 0, "Q6_K's inputs come in super-blocks of 256");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(1) == groups * Codes6Tile::kTileGroupBytes, "packed: contiguous uint8 (tiles, groups · 384)");
  TORCH_CHECK(scale.scalar_type() == at::kChar && scale.is_contiguous() && scale.numel() == tiles * groups * 2 * kTile,
              "scale: contiguous int8 (tiles, in / 32, 2, 16)");
  TORCH_CHECK(d.scalar_type() == at::kHalf && d.is_contiguous() && d.numel() == tiles * (groups / kSuperBlockGroups) * kTile,
              "d: contiguous float16 (tiles, in / 256, 16)");
  TORCH_CHECK(0 < out_features && out_features <= tiles * kTile && out_features > (tiles - 1) * kTile,
              "out_features must fall in the last tile");
  const int64_t padded = tiles * kTile;
  at::Tensor y = at::empty({m, padded}, rows.options().dtype(at::kFloat));
  const QuantizedRows x(rows, Codes6Tile::kCentre);
  const uint8_t* codes = packed.data_ptr<uint8_t>();
  const int8_t* scales = scale.data_ptr<int8_t>();
  const at::Half* ds = d.data_ptr<at::Half>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* p = codes + t * groups * Codes6Tile::kTileGroupBytes;
      const int8_t* s = scales + t * groups * 2 * kTile;
      const at::Half* dt = ds + t * (groups / kSuperBlockGroups) * kTile;
      int64_t r = 0;
      for (; r + kRowsPerPass <= m; r += kRowsPerPass)
        run_tile6<kRowsPerPass>(p, s, dt, groups, x, r, in, yp + r * padded + t * kTile, padded);
      for (; r < m; ++r) run_tile6<1>(p, s, dt, groups, x, r, in, yp + r * padded + t * kTile, padded);
    }
  });
  return padded == out_features ? y : y.narrow(1, 0, out_features).contiguous();
}

at::Tensor subblock6_product_meta(const at::Tensor& rows, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                  int64_t out_features) {
  return at::empty_symint({rows.sym_size(0), c10::SymInt(out_features)}, rows.options().dtype(at::kFloat));
}

}  // namespace
}  // namespace kvserve

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("subblock6_product(Tensor rows, Tensor packed, Tensor scale, Tensor d, int out_features) -> Tensor");
}
TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("subblock6_product", &kvserve::subblock6_product); }
TORCH_LIBRARY_IMPL(kvserve, Meta, m) { m.impl("subblock6_product", &kvserve::subblock6_product_meta); }
