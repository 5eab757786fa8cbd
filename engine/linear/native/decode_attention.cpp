// One decode step's attention, read where the keys and values lie in the cache:
//   out[r, i] = softmax_t(q[r, i]·K[slot r, i / g, t] / sqrt(d)) · V[slot r, i / g, t],  t in keys(r),
// for each row r and query head i, g = h_q / h_kv query heads per K/V head (the Hugging Face order).
// Position p is stored at entry p mod C of a layer of C entries per slot (C = T: every position has its own; a
// sliding layer may hold only its window, a ring). keys(r), for p = positions[r] and a window W (0: none):
// entries max(0, p - W + 1)..p while p < C; past that, in a ring, all C entries where it holds exactly the
// window's keys (C <= W), else (C > W: it also holds the positions a step verifying drafts writes past its newest
// token) the W entries of positions p - W + 1..p, which wrap around the ring's end at most once.
//
// A compiled decode step otherwise gathers each row's keys out of the cache, or loops over them in a form that
// reads them more than once; at long contexts (hundreds of keys and more) that, not the weights, is most of a
// step. Here every key and value of a row's slot is read once, as stored (bfloat16 or float32), by the g query
// heads that share it, in float32 (AVX2 vectors: d a multiple of 8). The keys are split into chunks, so that one
// row's long context spreads over every thread (split-K, as flash-decoding does); each chunk keeps its own maximum,
// sum and weighted values, merged per row and head at the end. A row's result depends on its own keys alone, never
// on the rows beside it: a verified draft's row is the row decoded alone at its position.
//
// q (b, h_q, 1, d) of the model's dtype; keys and values (B, h_kv, T, d), one layer's, each contiguous;
// slot_index (b,) and positions (b, 1) int64. Returns (b, h_q, 1, d) of the cache's dtype.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "eight.h"

namespace kvserve {
namespace {

constexpr int64_t kChunk = 256;  // keys per task

inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) {
  uint32_t bits = static_cast<uint32_t>(v.x) << 16;  // bfloat16 is float32's upper half
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// The sums of each of a[0..7]'s 8 lanes, as lanes 0..7 of one vector, in a fixed order.
inline __m256 lane_sums(const __m256 (&a)[8]) {
  const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));  // per 128-bit half
  const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// exp(x) for x <= 0, 8 at a time: x = n·ln 2 + r, |r| <= ln 2 / 2, exp(r) by its Taylor series to r⁶ (relative
// error under 2e-7), times 2^n. Below -87 (float32's smallest normal number is e^-87.3) it gives e^-87: a weight no
// sum can tell from 0.
inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x));
  __m256 p = _mm256_set1_ps(1.f / 720);  // ln 2 in two parts above: n·ln 2 exact to float
  for (const float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256i two_to_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_to_n));
}

constexpr int64_t kKeys = 8;  // keys scored at a time: one lane each
constexpr int64_t kHeads = 8;  // query heads whose weighted values are summed at a time: one register each

// Scratch of one thread: kKeys key rows, the chunk's scores, the queries in float32.
struct Scratch {
  std::vector<float> rows, scores, queries;
  Scratch(int64_t g, int64_t d) : rows(kKeys * d), scores(g * (kChunk + kKeys)), queries(g * d) {}
};

// out[h, :] = Σ_t weights[h, t]·values[t, :] for H heads (weights: row stride `stride`), S·8 of d at a time: H·S
// sums in registers, each key's 8·S values read once for all H heads.
template <int H, int S, typename T>
void weigh_values(const T* values, int64_t n, int64_t d, const float* weights, int64_t stride, float* out) {
  for (int64_t j = 0; j < d; j += 8 * S) {
    __m256 acc[H][S];
    for (int h = 0; h < H; ++h)
      for (int s = 0; s < S; ++s) acc[h][s] = _mm256_setzero_ps();
    for (int64_t t = 0; t < n; ++t) {
      __m256 v[S];
      for (int s = 0; s < S; ++s) v[s] = load8(values + t * d + j + 8 * s);
      for (int h = 0; h < H; ++h) {
        const __m256 w = _mm256_broadcast_ss(weights + h * stride + t);
        for (int s = 0; s < S; ++s) acc[h][s] = _mm256_fmadd_ps(w, v[s], acc[h][s]);
      }
    }
    for (int h = 0; h < H; ++h)
      for (int s = 0; s < S; ++s) _mm256_storeu_ps(out + h * d + j + 8 * s, acc[h][s]);
  }
}

// weigh_values for `heads` (1..kHeads) heads: as many 8s of d at a time as keep about 8 sums in flight (an FMA's
// latency times the two a cycle), where d holds them.
template <typename T>
void weigh_values(const T* values, int64_t n, int64_t d, const float* weights, int64_t stride, int64_t heads,
                  float* out) {
  const bool four = d % 32 == 0, two = d % 16 == 0;
  switch (heads) {
#define KVSERVE_HEADS(H, S)                                                                                   \
  case H:                                                                                                     \
    if (S >= 4 && four) return weigh_values<H, (S >= 4 ? 4 : 1)>(values, n, d, weights, stride, out);        \
    if (S >= 2 && two) return weigh_values<H, (S >= 2 ? 2 : 1)>(values, n, d, weights, stride, out);         \
    return weigh_values<H, 1>(values, n, d, weights, stride, out);
    KVSERVE_HEADS(1, 4) KVSERVE_HEADS(2, 4) KVSERVE_HEADS(3, 2) KVSERVE_HEADS(4, 2)
    KVSERVE_HEADS(5, 1) KVSERVE_HEADS(6, 1) KVSERVE_HEADS(7, 1) KVSERVE_HEADS(8, 1)
#undef KVSERVE_HEADS
  }
  TORCH_CHECK(false, "weigh_values takes 1 to ", kHeads, " heads at a time");
}

// One chunk [begin, end) of one row's K/V head, for its g query heads (scratch.queries: g·d, scaled by 1/sqrt(d)),
// d a multiple of 8: each head's maximum score, sum of exp(score - maximum) and Σ exp(score - maximum)·v (d floats).
// Scores go 8 keys at a time (each key's row read and widened once for the g heads), the weighted values 8 of d
// at a time for up to 8 heads, each key's values read once per 8 of d.
template <typename T>
void attend_chunk(Scratch& scratch, const T* keys, const T* values, int64_t begin, int64_t end, int64_t g, int64_t d,
                  float* maximum, float* total, float* out) {
  const int64_t n = end - begin, padded = (n + kKeys - 1) / kKeys * kKeys;
  float* rows = scratch.rows.data();
  float* scores = scratch.scores.data();  // (g, padded)
  for (int64_t t = 0; t < n; t += kKeys) {
    for (int64_t i = 0; i < kKeys; ++i) {  // keys past n as zeros: their scores are not used
      const T* key = keys + (begin + t + i) * d;
      for (int64_t j = 0; j < d; j += 8)
        _mm256_storeu_ps(rows + i * d + j, t + i < n ? load8(key + j) : _mm256_setzero_ps());
    }
    for (int64_t h = 0; h < g; ++h) {
      const float* qh = scratch.queries.data() + h * d;
      __m256 acc[kKeys];
      for (int64_t i = 0; i < kKeys; ++i) acc[i] = _mm256_setzero_ps();
      for (int64_t j = 0; j < d; j += 8) {
        const __m256 qj = _mm256_loadu_ps(qh + j);
        for (int64_t i = 0; i < kKeys; ++i) acc[i] = _mm256_fmadd_ps(qj, _mm256_loadu_ps(rows + i * d + j), acc[i]);
      }
      _mm256_storeu_ps(scores + h * padded + t, lane_sums(acc));
    }
  }
  const __m256 lanes = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t h = 0; h < g; ++h) {
    float* sh = scores + h * padded;
    __m256 top = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t t = 0; t < padded; t += kKeys) {  // keys past n count as −∞
      const __m256 valid = _mm256_cmp_ps(_mm256_add_ps(lanes, _mm256_set1_ps(static_cast<float>(t))),
                                         _mm256_set1_ps(static_cast<float>(n)), _CMP_LT_OQ);
      top = _mm256_max_ps(top, _mm256_blendv_ps(top, _mm256_loadu_ps(sh + t), valid));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    const float most = _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
    __m256 sum = _mm256_setzero_ps();
    for (int64_t t = 0; t < padded; t += kKeys) {  // weights of keys past n: 0
      const __m256 valid = _mm256_cmp_ps(_mm256_add_ps(lanes, _mm256_set1_ps(static_cast<float>(t))),
                                         _mm256_set1_ps(static_cast<float>(n)), _CMP_LT_OQ);
      const __m256 w = _mm256_and_ps(valid, exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(sh + t), _mm256_set1_ps(most))));
      _mm256_storeu_ps(sh + t, w);
      sum = _mm256_add_ps(sum, w);
    }
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    maximum[h] = most, total[h] = _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
  }
  for (int64_t h0 = 0; h0 < g; h0 += kHeads)
    weigh_values(values + begin * d, n, d, scores + h0 * padded, padded, std::min(kHeads, g - h0), out + h0 * d);
}

template <typename T, typename Q>
at::Tensor attend(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& slot_index,
                  const at::Tensor& positions, int64_t window) {
  const int64_t b = q.size(0), h_q = q.size(1), d = q.size(3);
  const int64_t slots = keys.size(0), h_kv = keys.size(1), capacity = keys.size(2);
  const int64_t g = h_q / h_kv;
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  const int64_t* slot = slot_index.data_ptr<int64_t>();
  const int64_t* position = positions.data_ptr<int64_t>();
  // Row r's keys are one run of entries, or two where a ring's window wraps around its end. Each run is cut into
  // as few chunks as chunks of at most kChunk allow, as even as they can be, so that the threads' shares are too.
  // Row r's chunks are first[r]..first[r+1] - 1; chunk c reads entries chunk_begin[c]..chunk_end[c] - 1.
  std::vector<int64_t> first(b + 1, 0), chunk_begin, chunk_end;
  auto add_run = [&](int64_t lowest, int64_t count) {
    const int64_t chunks = (count + kChunk - 1) / kChunk, length = (count + chunks - 1) / chunks;
    for (int64_t c = 0; c < chunks; ++c) {
      chunk_begin.push_back(lowest + c * length);
      chunk_end.push_back(std::min(lowest + (c + 1) * length, lowest + count));
    }
  };
  for (int64_t r = 0; r < b; ++r) {
    const int64_t p = position[r];
    TORCH_CHECK(0 <= slot[r] && slot[r] < slots && 0 <= p && (p < capacity || window > 0),
                "slot_index and positions must fall inside the cache (past its end only in a ring)");
    if (p < capacity) {
      const int64_t lowest = window > 0 ? std::max<int64_t>(0, p - window + 1) : 0;
      add_run(lowest, p + 1 - lowest);
    } else if (capacity <= window) {
      add_run(0, capacity);  // every entry holds one of the window's keys
    } else {
      const int64_t start = (p - window + 1) % capacity, head = std::min(window, capacity - start);
      add_run(start, head);
      if (head < window) add_run(0, window - head);  // the rest of the window, from the ring's first entry
    }
    first[r + 1] = static_cast<int64_t>(chunk_begin.size());
  }
  std::vector<int64_t> row_of(first[b]);
  for (int64_t r = 0; r < b; ++r) std::fill(row_of.begin() + first[r], row_of.begin() + first[r + 1], r);
  // Per (chunk, K/V head): g maxima, g sums, g·d weighted values.
  const int64_t stride = g * (d + 2);
  std::vector<float> partial(first[b] * h_kv * stride);
  const Q* q_data = q.data_ptr<Q>();
  const T* key_data = keys.data_ptr<T>();
  const T* value_data = values.data_ptr<T>();
  at::parallel_for(0, first[b] * h_kv, 1, [&](int64_t lo, int64_t hi) {
    Scratch scratch(g, d);
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t chunk = task / h_kv, head = task % h_kv, r = row_of[chunk];
      const int64_t begin = chunk_begin[chunk], end = chunk_end[chunk];
      for (int64_t h = 0; h < g; ++h) {
        const Q* qh = q_data + r * q.stride(0) + (head * g + h) * q.stride(1);
        for (int64_t j = 0; j < d; ++j) scratch.queries[h * d + j] = to_float(qh[j]) * scale;
      }
      const int64_t offset = (slot[r] * h_kv + head) * capacity * d;
      float* p = partial.data() + task * stride;
      attend_chunk<T>(scratch, key_data + offset, value_data + offset, begin, end, g, d, p, p + g, p + 2 * g);
    }
  });
  at::Tensor out = at::empty({b, h_q, 1, d}, q.options().dtype(keys.scalar_type()));
  T* o = out.data_ptr<T>();
  at::parallel_for(0, b * h_kv, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> acc(d);
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t r = task / h_kv, head = task % h_kv;
      for (int64_t h = 0; h < g; ++h) {  // merge the row's chunks: rescale each to the largest maximum
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t c = first[r]; c < first[r + 1]; ++c) top = std::max(top, partial[(c * h_kv + head) * stride + h]);
        std::fill(acc.begin(), acc.end(), 0.f);
        float sum = 0;
        for (int64_t c = first[r]; c < first[r + 1]; ++c) {
          const float* p = partial.data() + (c * h_kv + head) * stride;
          const float weight = std::exp(p[h] - top);
          sum += weight * p[g + h];
          for (int64_t j = 0; j < d; ++j) acc[j] += weight * p[2 * g + h * d + j];
        }
        T* dst = o + (r * h_q + head * g + h) * d;
        for (int64_t j = 0; j < d; ++j) dst[j] = static_cast<T>(acc[j] / sum);
      }
    }
  });
  return out;
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                            const at::Tensor& slot_index, const at::Tensor& positions, int64_t window) {
  TORCH_CHECK(q.dim() == 4 && q.size(2) == 1, "q: (b, h_q, 1, d)");
  TORCH_CHECK(keys.dim() == 4 && keys.is_contiguous() && values.is_contiguous() && keys.sizes() == values.sizes() &&
                  keys.scalar_type() == values.scalar_type() && keys.size(3) == q.size(3) &&
                  q.size(1) % keys.size(1) == 0, "keys and values: contiguous (B, h_kv, T, d), h_kv dividing h_q");
  TORCH_CHECK(slot_index.scalar_type() == at::kLong && positions.scalar_type() == at::kLong &&
                  slot_index.is_contiguous() && positions.is_contiguous() && slot_index.numel() == q.size(0) &&
                  positions.numel() == q.size(0), "slot_index (b,) and positions (b, 1): contiguous int64");
  TORCH_CHECK(q.stride(3) == 1 && q.scalar_type() == keys.scalar_type(), "q: each head's d contiguous, of the cache's dtype");
  TORCH_CHECK(q.size(3) % 8 == 0, "the head width must be a multiple of 8");
  if (keys.scalar_type() == at::kBFloat16) return attend<at::BFloat16, at::BFloat16>(q, keys, values, slot_index, positions, window);
  TORCH_CHECK(keys.scalar_type() == at::kFloat, "keys and values: bfloat16 or float32");
  return attend<float, float>(q, keys, values, slot_index, positions, window);
}

at::Tensor decode_attention_meta(const at::Tensor& q, const at::Tensor& keys, const at::Tensor&, const at::Tensor&,
                                 const at::Tensor&, int64_t) {
  return at::empty_symint(q.sym_sizes(), q.options().dtype(keys.scalar_type()));
}

}  // namespace
}  // namespace kvserve

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("decode_attention(Tensor q, Tensor keys, Tensor values, Tensor slot_index, Tensor positions, int window) -> Tensor");
}
TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("decode_attention", &kvserve::decode_attention); }
TORCH_LIBRARY_IMPL(kvserve, Meta, m) { m.impl("decode_attention", &kvserve::decode_attention_meta); }
