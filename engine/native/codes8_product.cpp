// rows (m, in) float32 · W(out, in)ᵀ -> (m, out) float32, W held as 8-bit group codes (GGUF's Q8_0 blocks):
// w[o, i] = scale[o, g]·codes[o, i] + minimum[o, g], g = i / 32, codes int8, scale and minimum float16.
//
// Built at load by engine/native.py for the CPU it runs on (-march=native), so the vector width is what
// this CPU has: AVX-512 or AVX2 (with F16C). A product of few rows is a read of the weight: each 32-code
// block is widened to float once and multiplied into up to four rows while it sits in registers.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <vector>

#if !defined(__AVX2__) || !defined(__F16C__)
#error "codes8_product needs AVX2 and F16C"
#endif

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kRowsPerTile = 4;

typedef float v16f __attribute__((vector_size(64)));  // one AVX-512 register, or two AVX2 ones

inline v16f load_floats(const float* p) {
  v16f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// 16 signed bytes -> 16 floats
inline v16f widen(const int8_t* p) {
  v16f v;
#ifdef __AVX512F__
  __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  std::memcpy(&v, &w, sizeof v);
#else
  __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  __m256 low = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
  __m256 high = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)));
  std::memcpy(&v, &low, 32);
  std::memcpy(reinterpret_cast<char*>(&v) + 32, &high, 32);
#endif
  return v;
}

inline float sum_lanes(v16f v) {
  float s = 0;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}

void halves_to_floats(const at::Half* h, float* f, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(h);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bits + i))));
  for (; i < n; ++i) f[i] = _cvtsh_ss(bits[i]);
}

// R rows of x (stride in) · one output row of codes -> out[r·out_stride]; group_sums (R, groups): Σ x over each group,
// for the minimum's share, which is the same for every code of a group.
template <int R>
void tile(const float* x, const float* group_sums, int64_t in, const int8_t* codes, const float* scale,
          const float* minimum, float* out, int64_t out_stride) {
  const int64_t groups = in / kGroup;
  v16f acc[R];
  float shift[R];
  for (int r = 0; r < R; ++r) acc[r] = v16f{}, shift[r] = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const v16f low = widen(codes + g * kGroup), high = widen(codes + g * kGroup + 16);
    for (int r = 0; r < R; ++r) {
      const float* xg = x + r * in + g * kGroup;
      acc[r] += (low * load_floats(xg) + high * load_floats(xg + 16)) * scale[g];
      shift[r] += minimum[g] * group_sums[r * groups + g];
    }
  }
  for (int r = 0; r < R; ++r) out[r * out_stride] = sum_lanes(acc[r]) + shift[r];
}

at::Tensor codes8_product(const at::Tensor& rows, const at::Tensor& codes, const at::Tensor& scale,
                          const at::Tensor& minimum) {
  TORCH_CHECK(rows.dim() == 2 && rows.scalar_type() == at::kFloat && rows.is_contiguous(), "rows: contiguous float32 (m, in)");
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.is_contiguous(), "codes: contiguous int8 (out, in)");
  TORCH_CHECK(scale.scalar_type() == at::kHalf && minimum.scalar_type() == at::kHalf && scale.is_contiguous() &&
                  minimum.is_contiguous(), "scale and minimum: contiguous float16 (out, in / 32)");
  const int64_t m = rows.size(0), in = rows.size(1), out = codes.size(0), groups = in / kGroup;
  TORCH_CHECK(in % kGroup == 0 && codes.size(1) == in && scale.size(0) == out && scale.size(1) == groups &&
                  minimum.sizes() == scale.sizes(), "shapes: rows (m, in), codes (out, in), scale and minimum (out, in / 32)");
  at::Tensor y = at::empty({m, out}, rows.options());
  const float* x = rows.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  std::vector<float> group_sums(m * groups);  // (m, groups)
  for (int64_t i = 0; i < m * groups; ++i) {
    float s = 0;
    for (int64_t j = 0; j < kGroup; ++j) s += x[i * kGroup + j];
    group_sums[i] = s;
  }
  const int8_t* c = codes.data_ptr<int8_t>();
  const at::Half* scales = scale.data_ptr<at::Half>();
  const at::Half* minimums = minimum.data_ptr<at::Half>();
  at::parallel_for(0, out, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row_scale(groups), row_minimum(groups);
    for (int64_t o = begin; o < end; ++o) {
      halves_to_floats(scales + o * groups, row_scale.data(), groups);
      halves_to_floats(minimums + o * groups, row_minimum.data(), groups);
      const int8_t* row_codes = c + o * in;
      int64_t r = 0;
      for (; r + kRowsPerTile <= m; r += kRowsPerTile)
        tile<kRowsPerTile>(x + r * in, group_sums.data() + r * groups, in, row_codes, row_scale.data(),
                           row_minimum.data(), yp + r * out + o, out);
      for (; r < m; ++r)
        tile<1>(x + r * in, group_sums.data() + r * groups, in, row_codes, row_scale.data(), row_minimum.data(),
                yp + r * out + o, out);
    }
  });
  return y;
}

// The output's shape for torch.compile's tracing: symbolic sizes, so a graph traced with a dynamic row count
// keeps it dynamic.
at::Tensor codes8_product_meta(const at::Tensor& rows, const at::Tensor& codes, const at::Tensor&, const at::Tensor&) {
  return at::empty_symint({rows.sym_size(0), codes.sym_size(0)}, rows.options());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("codes8_product(Tensor rows, Tensor codes, Tensor scale, Tensor minimum) -> Tensor");
}
TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("codes8_product", &codes8_product); }
TORCH_LIBRARY_IMPL(kvserve, Meta, m) { m.impl("codes8_product", &codes8_product_meta); }
