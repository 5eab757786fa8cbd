// Each row of a step's logits -> its most likely token and its log-sum-exp, what the sampler needs of every row
// (the greedy token, and the log-probability of whichever token is chosen):
//   best[r]     = the first index of the row's maximum (as torch's argmax)
//   log_norm[r] = max + log Σ exp(x - max), the exponentials in float32, their sum in float64
// A row with a NaN or +inf logit, or with no finite one, gets a non-finite log_norm (the caller raises).
//
// Why a kernel: torch's max(dim) and argmax run over a vocabulary as a scalar loop (several times its amax; figures
// in bench/README), and its sum of exponentials splits one row across threads but not many: a few percent of a
// small model's decode step, and a row's last bits that depended on how many rows came with it. Here a row's result
// depends on that row alone, whatever the batch.
//
// logits (b, V) float32, contiguous. Returns (best (b,) int64, log_norm (b,) float32).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include "eight.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>

namespace kvserve {
namespace {

// (first index of the maximum, log-sum-exp) of one row, in one fixed order of operations.
std::tuple<int64_t, float> row_log_norm(const float* x, int64_t n) {
  const float lowest = -std::numeric_limits<float>::infinity();
  __m256 top = _mm256_set1_ps(lowest), unordered = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    top = _mm256_max_ps(top, v);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));  // NaN lanes
  }
  float most = lanes_max(top);
  bool nan = _mm256_movemask_ps(unordered) != 0;
  for (int64_t j = i; j < n; ++j) {
    nan = nan || std::isnan(x[j]);
    most = x[j] > most ? x[j] : most;
  }
  if (nan) return {0, std::numeric_limits<float>::quiet_NaN()};
  if (!std::isfinite(most)) return {0, most == lowest ? lowest : most};  // no finite logit, or +inf: non-finite

  const __m256 target = _mm256_set1_ps(most);
  for (i = 0; i + 8 <= n; i += 8)  // the first 8 holding the maximum
    if (_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), target, _CMP_EQ_OQ))) break;
  while (x[i] != most) ++i;  // within those 8, or in the tail
  const int64_t best = i;

  __m256d sum[2] = {_mm256_setzero_pd(), _mm256_setzero_pd()};
  for (i = 0; i + 8 <= n; i += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(x + i), target));
    sum[0] = _mm256_add_pd(sum[0], _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
    sum[1] = _mm256_add_pd(sum[1], _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
  }
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, _mm256_add_pd(sum[0], sum[1]));
  double total = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  for (; i < n; ++i) total += std::exp(static_cast<double>(x[i] - most));
  return {best, static_cast<float>(static_cast<double>(most) + std::log(total))};
}

std::tuple<at::Tensor, at::Tensor> log_norm(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous() && logits.size(1) > 0,
              "logits: (b, V) float32, contiguous, V > 0");
  const int64_t rows = logits.size(0), n = logits.size(1);
  at::Tensor best = at::empty({rows}, logits.options().dtype(at::kLong));
  at::Tensor norms = at::empty({rows}, logits.options());
  const float* x = logits.data_ptr<float>();
  int64_t* b = best.data_ptr<int64_t>();
  float* l = norms.data_ptr<float>();
  // A row is tens of microseconds: a few run on the calling thread, where a thread pool's wake-up would cost more.
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) std::tie(b[r], l[r]) = row_log_norm(x + r * n, n);
  });
  return {best, norms};
}

}  // namespace
}  // namespace kvserve

TORCH_LIBRARY_FRAGMENT(kvserve, m) { m.def("log_norm(Tensor logits) -> (Tensor, Tensor)"); }
TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("log_norm", &kvserve::log_norm); }
