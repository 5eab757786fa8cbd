// Each row of a step's logits -> its most likely token and its log-sum-exp, what the sampler needs of every row
// (the greedy token, and the log-probability of whichever token is chosen):
//   best[r]     = the first index of the row's maximum (as torch's argmax)
//   log_norm[r] = max + log Σ exp(x - max), the exponentials in float32, their sum in float64
// A row with a NaN or +inf logit, or with no finite one, gets a non-finite log_norm (the caller raises).
// And first_max: a row's best index alone, for scores a grammar or penalty changed (no exponentials).
//
// Why a kernel: torch's max(dim) and argmax run over a vocabulary as a scalar loop (several times its amax; figures
// in bench/README), and its sum of exponentials splits one row across threads but not many: a few percent of a
// small model's decode step, and a row's last bits that depended on how many rows came with it. Here a row's result
// depends on that row alone, whatever the batch.
//
// In the widest vectors the CPU has (lanes.h), the maxima and sums in several chains, so that a row is bound by
// the exponentials' arithmetic rather than one chain's latency.
//
// logits (b, V) float32, contiguous. Returns (best (b,) int64, log_norm (b,) float32).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include "lanes.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>

namespace kvserve {
namespace {

constexpr int kChains = 4;  // independent maxima and sums in flight: one chain waits on each add's latency

// The row's maximum (its NaNs passed over), its vectors in kChains chains; with `finite`, also whether every value
// is finite (v - v is 0 for those, NaN for NaN and the infinities), at one more operation a vector.
template <class L>
float row_max(const float* x, int64_t n, bool* finite = nullptr) {
  constexpr int64_t W = L::width;
  typename L::V top[kChains], odd[kChains];
  for (int c = 0; c < kChains; ++c) top[c] = L::set(-std::numeric_limits<float>::infinity()), odd[c] = L::zero();
  int64_t i = 0;
  if (finite != nullptr) {
    for (; i + kChains * W <= n; i += kChains * W)
      for (int c = 0; c < kChains; ++c) {
        const auto v = L::load(x + i + c * W);
        top[c] = L::max(top[c], v), odd[c] = L::add(odd[c], L::fnmadd(v, L::set(1.f), v));
      }
  } else {
    for (; i + kChains * W <= n; i += kChains * W)
      for (int c = 0; c < kChains; ++c) top[c] = L::max(top[c], L::load(x + i + c * W));
  }
  for (; i + W <= n; i += W) {
    const auto v = L::load(x + i);
    top[0] = L::max(top[0], v), odd[0] = L::add(odd[0], L::fnmadd(v, L::set(1.f), v));
  }
  float most = L::largest(L::max(L::max(top[0], top[1]), L::max(top[2], top[3])));
  float rest = L::total(L::add(L::add(odd[0], odd[1]), L::add(odd[2], odd[3])));
  for (; i < n; ++i) most = x[i] > most ? x[i] : most, rest += x[i] - x[i];
  if (finite != nullptr) *finite = rest == 0.f;
  return most;
}

// The first index holding `most`, or n if none does (a row of NaNs).
template <class L>
int64_t first_index(const float* x, int64_t n, float most) {
  const auto target = L::set(most);
  int64_t i = 0;
  for (; i + L::width <= n; i += L::width)  // the first vector holding it
    if (L::any_equal(L::load(x + i), target)) break;
  while (i < n && x[i] != most) ++i;  // within that vector, or in the tail
  return i;
}

// (first index of the maximum, log-sum-exp) of one row, in one fixed order of operations for a given width.
template <class L>
std::tuple<int64_t, float> row_log_norm(const float* x, int64_t n) {
  constexpr int64_t W = L::width;
  bool finite;
  const float most = row_max<L>(x, n, &finite);
  if (!finite) {  // -inf logits are allowed; a NaN or +inf, or no finite logit at all, make it non-finite
    if (std::any_of(x, x + n, [](float v) { return std::isnan(v) || v == std::numeric_limits<float>::infinity(); }) ||
        most == -std::numeric_limits<float>::infinity())
      return {0, std::numeric_limits<float>::quiet_NaN()};
  }
  const int64_t best = first_index<L>(x, n, most);

  const auto shift = L::set(-most);
  typename L::D wide[kChains / 2][2];
  for (auto& pair : wide) pair[0] = pair[1] = L::wide_zero();
  int64_t i = 0;
  for (; i + kChains / 2 * W <= n; i += kChains / 2 * W)
    for (int c = 0; c < kChains / 2; ++c)
      L::add_wide(wide[c], exp_nonpositive<L>(L::add(L::load(x + i + c * W), shift)));
  for (; i + W <= n; i += W) L::add_wide(wide[0], exp_nonpositive<L>(L::add(L::load(x + i), shift)));
  double total = L::wide_total(L::wide_add(L::wide_add(wide[0][0], wide[0][1]), L::wide_add(wide[1][0], wide[1][1])));
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
  // A row is tens of microseconds: two rows a thread at least, where a thread pool's wake-up would cost more.
  at::parallel_for(0, rows, 2, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) std::tie(b[r], l[r]) = row_log_norm<Widest>(x + r * n, n);
  });
  return {best, norms};
}

at::Tensor first_max(const at::Tensor& scores) {
  TORCH_CHECK(scores.dim() == 2 && scores.scalar_type() == at::kFloat && scores.is_contiguous() && scores.size(1) > 0,
              "scores: (b, V) float32, contiguous, V > 0");
  const int64_t rows = scores.size(0), n = scores.size(1);
  at::Tensor best = at::empty({rows}, scores.options().dtype(at::kLong));
  const float* x = scores.data_ptr<float>();
  int64_t* b = best.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {  // a few microseconds a row: on the calling thread
    const int64_t i = first_index<Widest>(x + r * n, n, row_max<Widest>(x + r * n, n));
    b[r] = i < n ? i : 0;
  }
  return best;
}

}  // namespace
}  // namespace kvserve

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("log_norm(Tensor logits) -> (Tensor, Tensor)");
  m.def("first_max(Tensor scores) -> Tensor");
}
TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("log_norm", &kvserve::log_norm);
  m.impl("first_max", &kvserve::first_max);
}
