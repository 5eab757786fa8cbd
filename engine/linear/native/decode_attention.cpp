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
// heads that share it, in float32 vectors of 16 (AVX-512, d a multiple of 16) or 8 (AVX2, d a multiple of 8). With
// AVX512_BF16, bfloat16 keys are scored as stored, by dot products of bfloat16 pairs into float32 (each product
// exact), never widened: a score is the most of the work at hundreds of keys. The keys are split into chunks, so that one
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
#include <type_traits>
#include <vector>

#include "eight.h"
#include "lanes.h"

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

constexpr int64_t kHeads = 8;  // query heads whose weighted values are summed at a time

// Scratch of one thread: a block of key rows, the chunk's scores, the queries in float32 (scaled by 1/sqrt(d)) and
// as stored (T, unscaled).
template <class L, typename T>
struct Scratch {
  std::vector<float> rows, scores, queries;
  std::vector<T> stored;
  Scratch(int64_t g, int64_t d) : rows(L::width * d), scores(g * (kChunk + L::width)), queries(g * d), stored(g * d) {}
};

// Whether scores are dot products of bfloat16 pairs (AVX512_BF16: the keys read as stored, never widened), for
// lanes L and keys of type T, where d holds whole vectors of pairs.
template <class L, typename T>
constexpr bool kPairs =
#if defined(__AVX512BF16__)
    std::is_same_v<L, Lanes16> && std::is_same_v<T, at::BFloat16>;
#else
    false;
#endif

// The scores of keys [t, t + W) of a chunk of n for the g heads, each key's row read once for the g heads: in
// float32, widened into scratch rows; or (kPairs) as pairs of bfloat16 straight from the cache.
template <class L, typename T>
void score_keys(Scratch<L, T>& scratch, const T* keys, int64_t t, int64_t n, int64_t g, int64_t d, float scale,
                float* scores, int64_t padded) {
  constexpr int64_t W = L::width;
#if defined(__AVX512BF16__)
  if constexpr (kPairs<L, T>) {
    const T* key[W];
    for (int64_t i = 0; i < W; ++i) key[i] = keys + std::min(t + i, n - 1) * d;  // past n: scored, replaced later
    for (int64_t h = 0; h < g; ++h) {
      const T* qh = scratch.stored.data() + h * d;
      __m512 acc[W];
      for (int64_t i = 0; i < W; ++i) acc[i] = _mm512_setzero_ps();
      for (int64_t j = 0; j < d; j += 32) {
        const __m512bh qj = (__m512bh)_mm512_loadu_si512(qh + j);
        for (int64_t i = 0; i < W; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], qj, (__m512bh)_mm512_loadu_si512(key[i] + j));
      }
      L::store(scores + h * padded + t, L::mul(L::lane_sums(acc), L::set(scale)));
    }
    return;
  }
#endif
  float* rows = scratch.rows.data();
  for (int64_t i = 0; i < W; ++i) {  // keys past n as zeros: their scores are replaced later
    const T* key = keys + (t + i) * d;
    for (int64_t j = 0; j < d; j += W) L::store(rows + i * d + j, t + i < n ? L::load(key + j) : L::zero());
  }
  for (int64_t h = 0; h < g; ++h) {
    const float* qh = scratch.queries.data() + h * d;
    typename L::V acc[W];
    for (int64_t i = 0; i < W; ++i) acc[i] = L::zero();
    for (int64_t j = 0; j < d; j += W) {
      const auto qj = L::load(qh + j);
      for (int64_t i = 0; i < W; ++i) acc[i] = L::fmadd(qj, L::load(rows + i * d + j), acc[i]);
    }
    L::store(scores + h * padded + t, L::lane_sums(acc));
  }
}

// out[h, :] = Σ_t weights[h, t]·values[t, :] for H heads (weights: row stride `stride`), S vectors of d at a
// time: H·S sums in registers, each key's S vectors of values read once for all H heads.
template <class L, int H, int S, typename T>
void weigh_values(const T* values, int64_t n, int64_t d, const float* weights, int64_t stride, float* out) {
  for (int64_t j = 0; j < d; j += L::width * S) {
    typename L::V acc[H][S];
    for (int h = 0; h < H; ++h)
      for (int s = 0; s < S; ++s) acc[h][s] = L::zero();
    for (int64_t t = 0; t < n; ++t) {
      typename L::V v[S];
      for (int s = 0; s < S; ++s) v[s] = L::load(values + t * d + j + L::width * s);
      for (int h = 0; h < H; ++h) {
        const auto w = L::broadcast(weights + h * stride + t);
        for (int s = 0; s < S; ++s) acc[h][s] = L::fmadd(w, v[s], acc[h][s]);
      }
    }
    for (int h = 0; h < H; ++h)
      for (int s = 0; s < S; ++s) L::store(out + h * d + j + L::width * s, acc[h][s]);
  }
}

// weigh_values for H heads: up to 4 vectors of d at a time, as many as d divides and L's registers hold beside
// the H broadcasts and S values.
template <class L, int H, typename T>
void weigh_values(const T* values, int64_t n, int64_t d, const float* weights, int64_t stride, float* out) {
  constexpr int most = std::min(4, std::max(1, L::sums / H));
  if constexpr (most >= 4)
    if (d % (4 * L::width) == 0) return weigh_values<L, H, 4>(values, n, d, weights, stride, out);
  if constexpr (most >= 2)
    if (d % (2 * L::width) == 0) return weigh_values<L, H, 2>(values, n, d, weights, stride, out);
  weigh_values<L, H, 1>(values, n, d, weights, stride, out);
}

template <class L, typename T>
void weigh_values(const T* values, int64_t n, int64_t d, const float* weights, int64_t stride, int64_t heads,
                  float* out) {
  switch (heads) {
    case 1: return weigh_values<L, 1>(values, n, d, weights, stride, out);
    case 2: return weigh_values<L, 2>(values, n, d, weights, stride, out);
    case 3: return weigh_values<L, 3>(values, n, d, weights, stride, out);
    case 4: return weigh_values<L, 4>(values, n, d, weights, stride, out);
    case 5: return weigh_values<L, 5>(values, n, d, weights, stride, out);
    case 6: return weigh_values<L, 6>(values, n, d, weights, stride, out);
    case 7: return weigh_values<L, 7>(values, n, d, weights, stride, out);
    case 8: return weigh_values<L, 8>(values, n, d, weights, stride, out);
  }
  TORCH_CHECK(false, "weigh_values takes 1 to ", kHeads, " heads at a time");
}

// One chunk [begin, end) of one row's K/V head, for its g query heads (scratch.queries: g·d, scaled by 1/sqrt(d)),
// d a multiple of L::width: each head's maximum score, sum of exp(score - maximum) and Σ exp(score - maximum)·v
// (d floats). Scores go L::width keys at a time (each key's row read and widened once for the g heads; keys past
// the chunk score −∞), the weighted values up to 8 heads at a time, each key's values read once per pass over d.
template <class L, typename T>
void attend_chunk(Scratch<L, T>& scratch, const T* keys, const T* values, int64_t begin, int64_t end, int64_t g,
                  int64_t d, float scale, float* maximum, float* total, float* out) {
  constexpr int64_t W = L::width;
  const int64_t n = end - begin, padded = (n + W - 1) / W * W;
  float* scores = scratch.scores.data();  // (g, padded)
  for (int64_t t = 0; t < n; t += W) score_keys<L, T>(scratch, keys + begin * d, t, n, g, d, scale, scores, padded);
  for (int64_t h = 0; h < g; ++h) {
    float* sh = scores + h * padded;
    std::fill(sh + n, sh + padded, -std::numeric_limits<float>::infinity());
    auto top = L::set(-std::numeric_limits<float>::infinity());
    for (int64_t t = 0; t < padded; t += W) top = L::max(top, L::load(sh + t));
    const float most = L::largest(top);
    auto sum = L::zero();
    for (int64_t t = 0; t < padded; t += W) {
      const auto w = exp_nonpositive<L>(L::add(L::load(sh + t), L::set(-most)));
      L::store(sh + t, w);
      sum = L::add(sum, w);
    }
    maximum[h] = most, total[h] = L::total(sum);
  }
  for (int64_t h0 = 0; h0 < g; h0 += kHeads)
    weigh_values<L>(values + begin * d, n, d, scores + h0 * padded, padded, std::min(kHeads, g - h0), out + h0 * d);
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
  // Each (chunk, K/V head) a task, in the widest vectors the CPU has and d divides: the same for every row.
  auto attend_chunks = [&](auto lanes) {
    using L = decltype(lanes);
    at::parallel_for(0, first[b] * h_kv, 1, [&](int64_t lo, int64_t hi) {
      Scratch<L, T> scratch(g, d);
      for (int64_t task = lo; task < hi; ++task) {
        const int64_t chunk = task / h_kv, head = task % h_kv, r = row_of[chunk];
        for (int64_t h = 0; h < g; ++h) {
          const Q* qh = q_data + r * q.stride(0) + (head * g + h) * q.stride(1);
          if constexpr (kPairs<L, T>)  // the queries as score_keys reads them: as stored, or widened and scaled
            std::copy(qh, qh + d, scratch.stored.data() + h * d);
          else
            for (int64_t j = 0; j < d; ++j) scratch.queries[h * d + j] = to_float(qh[j]) * scale;
        }
        const int64_t offset = (slot[r] * h_kv + head) * capacity * d;
        float* p = partial.data() + task * stride;
        attend_chunk<L, T>(scratch, key_data + offset, value_data + offset, chunk_begin[chunk], chunk_end[chunk], g,
                           d, scale, p, p + g, p + 2 * g);
      }
    });
  };
#if defined(__AVX512F__)
  if (d % Lanes16::width == 0 && (!kPairs<Lanes16, T> || d % 32 == 0))
    attend_chunks(Lanes16{});
  else
#endif
    attend_chunks(Lanes8{});
  at::Tensor out = at::empty({b, h_q, 1, d}, q.options().dtype(keys.scalar_type()));
  T* o = out.data_ptr<T>();
  at::parallel_for(0, b * h_kv, b * h_kv, [&](int64_t lo, int64_t hi) {
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
