// rows (m, in) float32 · W(out, in)ᵀ -> (m, out) float32, W held as 8-bit group codes (GGUF's Q8_0 blocks):
// w[o, i] = scale[o, g]·codes[o, i] + minimum[o, g], g = i / 32, codes in [0, 256).
//
// As codes4_product.cpp, integer dot products of 16 output rows at once against the inputs quantized to 8 bits
// per group of 32, with the codes centred on 128 (Σ (q - 128)·x̂ = Σ q·x̂ - 128·Σ x̂) and the rest of each
// weight, minimum + 128·scale (zero for Q8_0, whose blocks are d·(q - 128)), meeting the exact Σ x.
// AVX512-VNNI: vpdpbusd of the unsigned codes and the signed inputs. AVX2: vpmaddubsw of |q - 128| and the
// inputs carrying its sign (|q - 128| <= 128 and |x̂| <= 127, so a pair's sum fits in int16), then vpmaddwd.
//
// Layout (`packed`, made by engine/quantization.py): tiles of 16 output rows; per tile and group, 512 bytes in
// eight runs of 64; run k holds, for row j at bytes 4j..4j+3, the codes of inputs 4k..4k+3. scale and minimum:
// float16 (tiles, groups, 16).
#include <immintrin.h>
#include <torch/library.h>

#include "group_product.h"

namespace kvserve {
namespace {

struct Codes8Tile {
  static constexpr int64_t kTileGroupBytes = kTile * kGroup;
  static constexpr int32_t kCentre = 128;

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)

// R input rows · one tile of 16 output rows -> y[r·out + 0..15]
template <int R>
static void run(const uint8_t* packed, const at::Half* scale, const at::Half* minimum, int64_t groups,
                  const QuantizedRows& x, int64_t row, int64_t in, float* y, int64_t out) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i w[8];  // w[k]: inputs 4k..4k+3 of the group, for each of the 16 rows
    for (int k = 0; k < 8; ++k) w[k] = _mm512_loadu_si512(packed + g * kTileGroupBytes + 64 * k);
    const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scale + g * kTile)));
    const __m512 rest = _mm512_fmadd_ps(_mm512_set1_ps(128.f), s,
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

#else  // AVX2: each 64-byte run is two halves of 8 rows

// acc + Σ over 4-byte lanes of (q - 128)·x, q unsigned codes, x signed
static __m256i dot_centred(__m256i acc, __m256i q, __m256i x) {
  const __m256i centred = _mm256_xor_si256(q, _mm256_set1_epi8(static_cast<char>(0x80)));  // q - 128, as int8
  const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(centred), _mm256_sign_epi8(x, centred));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

template <int R>
static void run(const uint8_t* packed, const at::Half* scale, const at::Half* minimum, int64_t groups,
                  const QuantizedRows& x, int64_t row, int64_t in, float* y, int64_t out) {
  for (int half = 0; half < 2; ++half) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      __m256i w[8];
      for (int k = 0; k < 8; ++k)
        w[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed + g * kTileGroupBytes + 64 * k + 32 * half));
      const int64_t lanes = g * kTile + 8 * half;
      const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scale + lanes)));
      const __m256 rest = _mm256_fmadd_ps(_mm256_set1_ps(128.f), s,
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(minimum + lanes))));
      for (int r = 0; r < R; ++r) {
        const int64_t rg = (row + r) * groups + g;
        const int8_t* codes = x.codes.data() + (row + r) * in + g * kGroup;
        __m256i even = _mm256_setzero_si256(), odd = _mm256_setzero_si256();
        for (int k = 0; k < 8; k += 2) {
          even = dot_centred(even, w[k], _mm256_set1_epi32(four_codes(codes + 4 * k)));
          odd = dot_centred(odd, w[k + 1], _mm256_set1_epi32(four_codes(codes + 4 * k + 4)));
        }
        // dot_centred already took the 128 off the codes: nothing to subtract
        const __m256i centred = _mm256_add_epi32(even, odd);
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
  m.def("codes8_product(Tensor rows, Tensor packed, Tensor scale, Tensor minimum, int out_features) -> Tensor");
}
TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("codes8_product", &kvserve::group_product<kvserve::Codes8Tile>); }
TORCH_LIBRARY_IMPL(kvserve, Meta, m) { m.impl("codes8_product", &kvserve::group_product_meta); }
