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
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if !defined(__AVX2__) || !defined(__F16C__) || !defined(__FMA__)
#error "codes4_product needs AVX2, FMA and F16C"
#endif

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kTile = 16;  // output rows per tile
constexpr int64_t kTileGroupBytes = kTile * kGroup / 2;
constexpr int kRowsPerPass = 4;  // input rows that share one unpacking of a tile's codes

// The input rows, group by group: 8-bit codes, their scale, the exact sum, and 8·Σ codes (the centring term).
struct QuantizedRows {
  std::vector<int8_t> codes;  // (m, in)
  std::vector<float> scale, sum;  // (m, groups)
  std::vector<int32_t> code_sum8;  // (m, groups)

  QuantizedRows(const float* x, int64_t m, int64_t in)
      : codes(m * in), scale(m * in / kGroup), sum(m * in / kGroup), code_sum8(m * in / kGroup) {
    for (int64_t i = 0; i < m * in / kGroup; ++i) {
      const float* v = x + i * kGroup;
      float largest = 0, total = 0;
      for (int64_t j = 0; j < kGroup; ++j) largest = std::max(largest, std::fabs(v[j])), total += v[j];
      const float inverse = largest > 0 ? 127.f / largest : 0.f;
      int32_t code_total = 0;
      for (int64_t j = 0; j < kGroup; ++j) {
        const int8_t q = static_cast<int8_t>(std::nearbyint(v[j] * inverse));
        codes[i * kGroup + j] = q;
        code_total += q;
      }
      scale[i] = largest / 127.f, sum[i] = total, code_sum8[i] = 8 * code_total;
    }
  }
};

inline int32_t four_codes(const int8_t* p) {  // 4 input codes as one broadcastable dword
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)

// R input rows · one tile of 16 output rows -> y[r·out + 0..15]
template <int R>
void tile(const uint8_t* packed, const at::Half* scale, const at::Half* minimum, int64_t groups,
          const QuantizedRows& x, int64_t row, int64_t in, float* y, int64_t out) {
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i w[8];  // w[k]: inputs 4k..4k+3 of the group, for each of the 16 rows
    for (int k = 0; k < 4; ++k) {
      const __m512i run = _mm512_loadu_si512(packed + g * kTileGroupBytes + 64 * k);
      w[2 * k] = _mm512_and_si512(run, low_nibbles);
      w[2 * k + 1] = _mm512_and_si512(_mm512_srli_epi16(run, 4), low_nibbles);
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
      const __m512i centred = _mm512_sub_epi32(_mm512_add_epi32(even, odd), _mm512_set1_epi32(x.code_sum8[rg]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(centred), _mm512_mul_ps(s, _mm512_set1_ps(x.scale[rg])), acc[r]);
      acc[r] = _mm512_fmadd_ps(rest, _mm512_set1_ps(x.sum[rg]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * out, acc[r]);
}

#else  // AVX2: each 64-byte run is two halves of 8 rows; vpmaddubsw + vpmaddwd stand for vpdpbusd

inline __m256i dot_bytes(__m256i acc, __m256i w, __m256i x) {
  const __m256i pairs = _mm256_maddubs_epi16(w, x);  // |15·127·2| fits in int16: no saturation
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

template <int R>
void tile(const uint8_t* packed, const at::Half* scale, const at::Half* minimum, int64_t groups,
          const QuantizedRows& x, int64_t row, int64_t in, float* y, int64_t out) {
  const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
  for (int half = 0; half < 2; ++half) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      __m256i w[8];
      for (int k = 0; k < 4; ++k) {
        const __m256i run = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(packed + g * kTileGroupBytes + 64 * k + 32 * half));
        w[2 * k] = _mm256_and_si256(run, low_nibbles);
        w[2 * k + 1] = _mm256_and_si256(_mm256_srli_epi16(run, 4), low_nibbles);
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
        const __m256i centred = _mm256_sub_epi32(_mm256_add_epi32(even, odd), _mm256_set1_epi32(x.code_sum8[rg]));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(centred), _mm256_mul_ps(s, _mm256_set1_ps(x.scale[rg])), acc[r]);
        acc[r] = _mm256_fmadd_ps(rest, _mm256_set1_ps(x.sum[rg]), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * out + 8 * half, acc[r]);
  }
}

#endif

at::Tensor codes4_product(const at::Tensor& rows, const at::Tensor& packed, const at::Tensor& scale,
                          const at::Tensor& minimum, int64_t out_features) {
  TORCH_CHECK(rows.dim() == 2 && rows.scalar_type() == at::kFloat && rows.is_contiguous(), "rows: contiguous float32 (m, in)");
  const int64_t m = rows.size(0), in = rows.size(1), groups = in / kGroup, tiles = packed.size(0);
  TORCH_CHECK(in % kGroup == 0 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(1) == groups * kTileGroupBytes, "packed: contiguous uint8 (tiles, in / 32 · 256)");
  TORCH_CHECK(scale.scalar_type() == at::kHalf && minimum.scalar_type() == at::kHalf && scale.is_contiguous() &&
                  minimum.is_contiguous() && scale.numel() == tiles * groups * kTile && minimum.sizes() == scale.sizes(),
              "scale and minimum: contiguous float16 (tiles, in / 32, 16)");
  TORCH_CHECK(0 < out_features && out_features <= tiles * kTile && out_features > (tiles - 1) * kTile,
              "out_features must fall in the last tile");
  const int64_t padded = tiles * kTile;
  at::Tensor y = at::empty({m, padded}, rows.options());
  const QuantizedRows x(rows.data_ptr<float>(), m, in);
  const uint8_t* codes = packed.data_ptr<uint8_t>();
  const at::Half* scales = scale.data_ptr<at::Half>();
  const at::Half* minimums = minimum.data_ptr<at::Half>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* p = codes + t * groups * kTileGroupBytes;
      const at::Half* s = scales + t * groups * kTile;
      const at::Half* mn = minimums + t * groups * kTile;
      int64_t r = 0;
      for (; r + kRowsPerPass <= m; r += kRowsPerPass)
        tile<kRowsPerPass>(p, s, mn, groups, x, r, in, yp + r * padded + t * kTile, padded);
      for (; r < m; ++r) tile<1>(p, s, mn, groups, x, r, in, yp + r * padded + t * kTile, padded);
    }
  });
  return padded == out_features ? y : y.narrow(1, 0, out_features).contiguous();
}

at::Tensor codes4_product_meta(const at::Tensor& rows, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               int64_t out_features) {
  return at::empty_symint({rows.sym_size(0), c10::SymInt(out_features)}, rows.options());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("codes4_product(Tensor rows, Tensor packed, Tensor scale, Tensor minimum, int out_features) -> Tensor");
}
TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("codes4_product", &codes4_product); }
TORCH_LIBRARY_IMPL(kvserve, Meta, m) { m.impl("codes4_product", &codes4_product_meta); }
