// rows (m, in) float32 · W(out, in)ᵀ -> (m, out) float32, W held as 4-bit group codes (GGUF's Q4_0 and Q4_1 blocks):
// w[o, i] = scale[o, g]·codes[o, i] + minimum[o, g], g = i / 32, codes in [0, 16).
//
// The products are integer dot products, as llama.cpp computes them: each row's group of 32 inputs is
// quantized to 8 bits (x ≈ d·x̂, d = max|x| / 127), and 16 output rows at once take Σ codes·x̂ in 32-bit
// integers (AVX512-VNNI's vpdpbusd, or AVX2's vpmaddubsw + vpmaddwd). The codes are centred on 8 before
// their product with the rounding error of x̂ (Σ (q - 8)·x̂ = Σ q·x̂ - 8·Σ x̂), and the rest of each weight
// (minimum + 8·scale) meets the exact Σ x: the error is that of centred 4-bit weights times 8-bit inputs.
//
// Layout (`packed`, made by engine/quantization.py): tiles of 16 output rows; per tile and group, 256 bytes
// in four runs of 64; run k holds, for row j at bytes 4j..4j+3, inputs 8k..8k+3 in the low nibbles and
// 8k+4..8k+7 in the high ones. One 64-byte run masked or shifted is one vpdpbusd operand for 16 rows, whose
// other operand is 4 input codes broadcast. scale and minimum: float16 (tiles, groups, 16).
#include <immintrin.h>
#include <torch/library.h>

#include "group_product.h"

namespace kvserve {
namespace {

struct Codes4Tile {
  static constexpr int64_t kTileGroupBytes = kTile * kGroup / 2;
  static constexpr int32_t kCentre = 8;

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)

// R input rows · one tile of 16 output rows -> y[r·out + 0..15]
template <int R>
static void run(const uint8_t* packed, const at::Half* scale, const at::Half* minimum, int64_t groups,
                  const QuantizedRows& x, int64_t row, int64_t in, float* y, int64_t out) {
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i w[8];  // w[k]: inputs 4k..4k+3 of the group, for each of the 16 rows
    for (int k = 0; k < 4; ++k) {
      const __m512i bytes = _mm512_loadu_si512(packed + g * kTileGroupBytes + 64 * k);
      w[2 * k] = _mm512_and_si512(bytes, low_nibbles);
      w[2 * k + 1] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low_nibbles);
    }
    const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scale + g * kTile)));
    const __m512 rest = _mm512_fmadd_ps(_mm512_set1_ps(8.f), s,
        _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(minimum + g * kTile))));
    for (int r = 0; r < R; ++r) {
      const int64_t rg = (row + r) * groups + g;
      const int8_t* codes = x.codes.data() + (row + r) * in + g * kGroup;
      __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();  // two chains: half the latency
      for (int k = 0; k < 8; k += 2) {
        even = _mm512_dpbusd_epi32(even, w[k], _mm512_set1_epi32(four_codes(codes + 4 * k)));
        odd = _mm512_dpbusd_epi32(odd, w[k + 1], _mm512_set1_epi32(four_codes(codes + 4 * k + 4)));
      }
      const __m512i centred = _mm512_sub_epi32(_mm512_add_epi32(even, odd), _mm512_set1_epi32(x.centred_sum[rg]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(centred), _mm512_mul_ps(s, _mm512_set1_ps(x.scale[rg])), acc[r]);
      acc[r] = _mm512_fmadd_ps(rest, _mm512_set1_ps(x.sum[rg]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * out, acc[r]);
}

#else  // AVX2: each 64-byte run is two halves of 8 rows; vpmaddubsw + vpmaddwd stand for vpdpbusd

static __m256i dot_bytes(__m256i acc, __m256i w, __m256i x) {
  const __m256i pairs = _mm256_maddubs_epi16(w, x);  // |15·127·2| fits in int16: no saturation
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

template <int R>
static void run(const uint8_t* packed, const at::Half* scale, const at::Half* minimum, int64_t groups,
                  const QuantizedRows& x, int64_t row, int64_t in, float* y, int64_t out) {
  const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
  for (int half = 0; half < 2; ++half) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      __m256i w[8];
      for (int k = 0; k < 4; ++k) {
        const __m256i bytes = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(packed + g * kTileGroupBytes + 64 * k + 32 * half));
        w[2 * k] = _mm256_and_si256(bytes, low_nibbles);
        w[2 * k + 1] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low_nibbles);
      }
      const int64_t lanes = g * kTile + 8 * half;
      const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scale + lanes)));
      const __m256 rest = _mm256_fmadd_ps(_mm256_set1_ps(8.f), s,
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(minimum + lanes))));
      for (int r = 0; r < R; ++r) {
        const int64_t rg = (row + r) * groups + g;
        const int8_t* codes = x.codes.data() + (row + r) * in + g * kGroup;
        __m256i even = _mm256_setzero_si256(), odd = _mm256_setzero_si256();
        for (int k = 0; k < 8; k += 2) {
          even = dot_bytes(even, w[k], _mm256_set1_epi32(four_codes(codes + 4 * k)));
          odd = dot_bytes(odd, w[k + 1], _mm256_set1_epi32(four_codes(codes + 4 * k + 4)));
        }
        const __m256i centred = _mm256_sub_epi32(_mm256_add_epi32(even, odd), _mm256_set1_epi32(x.centred_sum[rg]));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(centred), _mm256_mul_ps(s, _mm256_set1_ps(x.scale[rg])), acc[r]);
        acc[r] = _mm256_fmadd_ps(rest, _mm256_set1_ps(x.sum[rg]), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * out + 8 * half, acc[r]);
  }
}

#endif

};

}  // namespace
}  // namespace kvserve

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("codes4_product(Tensor rows, Tensor packed, Tensor scale, Tensor minimum, int out_features) -> Tensor");
}
TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("codes4_product", &kvserve::group_product<kvserve::Codes4Tile>); }
TORCH_LIBRARY_IMPL(kvserve, Meta, m) { m.impl("codes4_product", &kvserve::group_product_meta); }
