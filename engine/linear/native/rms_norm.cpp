// RMS norm of each row, in one fixed order of operations whatever the number of rows or the graph it runs in:
//   llama (offset false): out = w · T(x / rms(x))        (the normalized row rounded to T, then scaled in T)
//   gemma (offset true):  out = T(x / rms(x) · (1 + w))   (scaled in float32, then rounded)
// with rms(x) = sqrt(Σ x² / n + eps) in float32, T the dtype of x and w (bfloat16 or float32).
//
// Why a kernel for so small a thing: a norm is a reduction, and inductor generates its own code for every graph,
// its sum of squares in an order that depends on the vector width it chose and on the shapes (torch's eager kernel
// has yet another). Those sums differ in their last bits, and now and then the normalized value then rounds to the
// other side of a bfloat16 step, enough to flip a near tie many layers later: the compiled step gave a token other
// logits than the eager one, and on some CPUs the many-row graph other logits than the one-row graph, so a draft
// verified in a row of a batch could be kept where decoding alone would have picked another token. Here a row's
// result depends on that row alone: the same bits eager, in every compiled graph and at every row count.
//
// x (..., n) with contiguous rows, w (n,) of x's dtype. Returns x's shape and dtype.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "eight.h"

namespace kvserve {
namespace {

// A value as T holds it: rounded to bfloat16, or as it is.
inline __m256 as_held(__m256 v, const float*) { return v; }
inline __m256 as_held(__m256 v, const at::BFloat16*) { return round_bfloat16(v); }
inline float as_held(float v, const float*) { return v; }
inline float as_held(float v, const at::BFloat16*) { return static_cast<float>(at::BFloat16(v)); }

template <typename T>
void norm_row(const T* x, const T* w, T* out, int64_t n, float eps, bool offset) {
  // Σ x² in four vectors of 8 lanes, folded in a fixed order, then the tail.
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  int64_t i = 0;
  for (; i + 32 <= n; i += 32)
    for (int k = 0; k < 4; ++k) {
      const __m256 v = load8(x + i + 8 * k);
      acc[k] = _mm256_fmadd_ps(v, v, acc[k]);
    }
  for (; i + 8 <= n; i += 8) {
    const __m256 v = load8(x + i);
    acc[0] = _mm256_fmadd_ps(v, v, acc[0]);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
  float sum = 0;
  for (const float lane : lanes) sum += lane;
  for (; i < n; ++i) sum += static_cast<float>(x[i]) * static_cast<float>(x[i]);
  const float inverse = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
  const __m256 r = _mm256_set1_ps(inverse), one = _mm256_set1_ps(1.f);
  for (i = 0; i + 8 <= n; i += 8) {
    const __m256 normed = _mm256_mul_ps(load8(x + i), r);
    const __m256 scale = load8(w + i);
    store8(out + i, offset ? _mm256_mul_ps(normed, _mm256_add_ps(one, scale))
                           : _mm256_mul_ps(as_held(normed, x), scale));
  }
  for (; i < n; ++i) {
    const float normed = static_cast<float>(x[i]) * inverse, scale = static_cast<float>(w[i]);
    out[i] = static_cast<T>(offset ? normed * (1.f + scale) : as_held(normed, x) * scale);
  }
}

template <typename T>
at::Tensor norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool offset) {
  const int64_t n = x.size(-1), rows = x.numel() / n;
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  const T* src = x.data_ptr<T>();
  const T* w = weight.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  const float epsilon = static_cast<float>(eps);
  // Few rows (a decode step) run on the calling thread: a thread pool's wake-up costs more than they do.
  at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row<T>(src + r * n, w, dst + r * n, n, epsilon, offset);
  });
  return out;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool offset) {
  TORCH_CHECK(x.dim() >= 1 && x.is_contiguous(), "x: (..., n), contiguous");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(-1) &&
                  weight.scalar_type() == x.scalar_type(), "weight: (n,) of x's dtype");
  if (x.scalar_type() == at::kBFloat16) return norm<at::BFloat16>(x, weight, eps, offset);
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x: bfloat16 or float32");
  return norm<float>(x, weight, eps, offset);
}

at::Tensor rms_norm_meta(const at::Tensor& x, const at::Tensor&, double, bool) {
  return at::empty_symint(x.sym_sizes(), x.options());
}

}  // namespace
}  // namespace kvserve

TORCH_LIBRARY_FRAGMENT(kvserve, m) { m.def("rms_norm(Tensor x, Tensor weight, float eps, bool offset) -> Tensor"); }
TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("rms_norm", &kvserve::rms_norm); }
TORCH_LIBRARY_IMPL(kvserve, Meta, m) { m.impl("rms_norm", &kvserve::rms_norm_meta); }
