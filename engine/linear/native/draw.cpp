// One token per row from softmax(scores), by inverse transform sampling with the row's uniform number u in (0, 1)
// (engine/sampling.py's `draw`, which this replaces on the CPU):
//   w_i = exp(s_i − max) where s_i − max >= −87, else 0 (odds under 1e-37: float32 would take exp's slow path);
//   the token is the first whose cumulative weight passes u · Σ w.
// Sums in float64, in one fixed order: each run of 8 tokens summed as a tree, the runs one after another. The scan
// walks the same runs' sums to the run that passes the target, then that run token by token; where rounding within
// the run leaves the target unpassed, the run's last weighted token. A row's token depends on that row alone.
//
// Why a kernel: torch's form (max, exp, masked_fill, cumsum, searchsorted over (b, V)) took 0.35 ms for one row of
// a 49,152-token vocabulary and 2.1 ms for 11, a tenth of a sampled step; a grammar's forced token, where one
// token has weight, cost as much as any.
//
// scores (b, V) float32, contiguous, at least one finite score per row; u (b,) float32. Returns tokens (b,) int64.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "lanes.h"

namespace kvserve {
namespace {

constexpr int64_t kRun = 8;
constexpr float kNegligible = -87.f;

// The 8 weights of one run (0 where negligible) into w, and their sum (a fixed tree).
inline double run_weights(const float* s, __m256 most, float* w) {
  const __m256 x = _mm256_sub_ps(_mm256_loadu_ps(s), most);
  const __m256 kept = _mm256_cmp_ps(x, _mm256_set1_ps(kNegligible), _CMP_GE_OQ);
  if (_mm256_movemask_ps(kept) == 0) {  // most runs of a grammar's row, and of a cold one: nothing to exponentiate
    _mm256_storeu_ps(w, _mm256_setzero_ps());
    return 0.0;
  }
  const __m256 e = _mm256_and_ps(kept, exp_nonpositive<Lanes8>(_mm256_max_ps(x, _mm256_set1_ps(kNegligible))));
  _mm256_storeu_ps(w, e);
  const __m256d pairs =
      _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(e)), _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
  const __m128d two = _mm_add_pd(_mm256_castpd256_pd128(pairs), _mm256_extractf128_pd(pairs, 1));
  return _mm_cvtsd_f64(_mm_add_sd(two, _mm_unpackhi_pd(two, two)));
}

int64_t draw_row(const float* s, int64_t n, float u, std::vector<float>& w, std::vector<double>& runs) {
  const float lowest = -std::numeric_limits<float>::infinity();
  __m256 top = _mm256_set1_ps(lowest);
  int64_t i = 0;
  for (; i + kRun <= n; i += kRun) top = _mm256_max_ps(top, _mm256_loadu_ps(s + i));
  float most = lanes_max(top);
  for (int64_t j = i; j < n; ++j) most = s[j] > most ? s[j] : most;
  if (!std::isfinite(most)) return 0;  // no finite score: the caller refused such logits before masking

  const int64_t whole = n / kRun;
  w.resize(n);
  runs.resize(whole + 1);
  double total = 0.0;
  const __m256 m = _mm256_set1_ps(most);
  for (int64_t r = 0; r < whole; ++r) total += runs[r] = run_weights(s + r * kRun, m, w.data() + r * kRun);
  double tail = 0.0;  // the last tokens past whole runs: a run of their own, summed in order
  for (int64_t j = whole * kRun; j < n; ++j) {
    const float x = s[j] - most;
    w[j] = x >= kNegligible ? std::exp(x) : 0.f;
    tail += w[j];
  }
  total += runs[whole] = tail;

  const double target = static_cast<double>(u) * total;  // below the total, as u < 1
  double before = 0.0;
  for (int64_t r = 0; r <= whole; ++r) {
    if (before + runs[r] <= target) {
      before += runs[r];
      continue;
    }
    const int64_t end = std::min(n, (r + 1) * kRun);
    int64_t last = -1;
    for (int64_t j = r * kRun; j < end; ++j) {
      if (w[j] == 0.f) continue;
      before += w[j];
      last = j;
      if (before > target) return j;
    }
    return last;  // the run's own order of sums fell short of the target by a rounding: its last weighted token
  }
  // The runs' sums in order are the total, which passes the target: only a total of 0 (impossible: the maximum
  // weighs 1) or of infinity ends here.
  for (int64_t j = n - 1; j >= 0; --j)
    if (w[j] > 0.f) return j;
  return 0;
}

at::Tensor draw(const at::Tensor& scores, const at::Tensor& u) {
  TORCH_CHECK(scores.dim() == 2 && scores.scalar_type() == at::kFloat && scores.is_contiguous() && scores.size(1) > 0,
              "scores: (b, V) float32, contiguous, V > 0");
  TORCH_CHECK(u.dim() == 1 && u.scalar_type() == at::kFloat && u.is_contiguous() && u.size(0) == scores.size(0),
              "u: (b,) float32, one per row");
  const int64_t rows = scores.size(0), n = scores.size(1);
  at::Tensor tokens = at::empty({rows}, scores.options().dtype(at::kLong));
  const float* s = scores.data_ptr<float>();
  const float* uniform = u.data_ptr<float>();
  int64_t* t = tokens.data_ptr<int64_t>();
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {  // rows of tens of microseconds, as log_norm's
    std::vector<float> w;
    std::vector<double> runs;
    for (int64_t r = begin; r < end; ++r) t[r] = draw_row(s + r * n, n, uniform[r], w, runs);
  });
  return tokens;
}

}  // namespace
}  // namespace kvserve

TORCH_LIBRARY_FRAGMENT(kvserve, m) { m.def("draw(Tensor scores, Tensor u) -> Tensor"); }
TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("draw", &kvserve::draw); }
