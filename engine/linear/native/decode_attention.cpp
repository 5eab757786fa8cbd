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
// heads that share it, in float32. The keys are split into chunks, so that one row's long context spreads over
// every thread (split-K, as flash-decoding does); each chunk keeps its own maximum, sum and weighted values,
// merged per row and head at the end.
//
// q (b, h_q, 1, d) of the model's dtype; keys and values (B, h_kv, T, d), one layer's, each contiguous;
// slot_index (b,) and positions (b, 1) int64. Returns (b, h_q, 1, d) of the cache's dtype.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

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

// exp(x) for x <= 0 in plain float arithmetic that the compiler vectorizes (std::exp is a call per element):
// x = n·ln 2 + r, |r| <= ln 2 / 2, exp(r) by its Taylor series to r⁶ (relative error under 2e-7), times 2^n.
// Below -87 (float32's smallest normal number is e^-87.3) it returns e^-87: a weight no sum can tell from 0.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.f);
  const float n = std::nearbyint(x * 1.44269504f);
  const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f;  // ln 2 in two parts: n·ln 2 exact to float
  float p = 1.f / 720;
  p = p * r + 1.f / 120, p = p * r + 1.f / 24, p = p * r + 1.f / 6, p = p * r + 0.5f, p = p * r + 1.f, p = p * r + 1.f;
  return p * std::bit_cast<float>(static_cast<int32_t>(n + 127.f) << 23);
}

constexpr int64_t kKeys = 4;  // keys in flight: four independent sums, where one would wait on each addition

// Scratch of one thread: kKeys key or value rows, the chunk's scores, the queries in float32.
struct Scratch {
  std::vector<float> rows, scores, queries;
  Scratch(int64_t g, int64_t d) : rows(kKeys * d), scores(g * kChunk), queries(g * d) {}
};

// Rows t..t+kKeys-1 (those below n) of `from` (each d wide) in float32; the rest zero.
template <typename T>
inline void load_rows(const T* from, int64_t t, int64_t n, int64_t d, float* rows) {
  for (int64_t i = 0; i < kKeys; ++i) {
    float* row = rows + i * d;
    if (t + i < n) {
      const T* source = from + (t + i) * d;
#pragma omp simd
      for (int64_t j = 0; j < d; ++j) row[j] = to_float(source[j]);
    } else {
      std::fill(row, row + d, 0.f);
    }
  }
}

// One chunk [begin, end) of one row's K/V head, for its g query heads (scratch.queries: g·d, scaled by 1/sqrt(d)):
// each head's maximum score, sum of exp(score - maximum) and Σ exp(score - maximum)·v (d floats).
template <typename T>
void attend_chunk(Scratch& scratch, const T* keys, const T* values, int64_t begin, int64_t end, int64_t g, int64_t d,
                  float* maximum, float* total, float* out) {
  const int64_t n = end - begin;
  const float* r0 = scratch.rows.data();
  const float *r1 = r0 + d, *r2 = r0 + 2 * d, *r3 = r0 + 3 * d;
  float* scores = scratch.scores.data();  // (g, n)
  for (int64_t t = 0; t < n; t += kKeys) {
    load_rows(keys + begin * d, t, n, d, scratch.rows.data());
    for (int64_t h = 0; h < g; ++h) {
      const float* qh = scratch.queries.data() + h * d;
      float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
      for (int64_t j = 0; j < d; ++j) s0 += qh[j] * r0[j], s1 += qh[j] * r1[j], s2 += qh[j] * r2[j], s3 += qh[j] * r3[j];
      const float sums[kKeys] = {s0, s1, s2, s3};
      for (int64_t i = 0; i < kKeys && t + i < n; ++i) scores[h * n + t + i] = sums[i];
    }
  }
  for (int64_t h = 0; h < g; ++h) {
    float* sh = scores + h * n;
    const float top = *std::max_element(sh, sh + n);
    float sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; ++t) {
      sh[t] = exp_nonpositive(sh[t] - top);
      sum += sh[t];
    }
    maximum[h] = top, total[h] = sum;
    std::fill(out + h * d, out + (h + 1) * d, 0.f);
  }
  for (int64_t t = 0; t < n; t += kKeys) {
    load_rows(values + begin * d, t, n, d, scratch.rows.data());  // rows past n are zero: their weight is unread
    for (int64_t h = 0; h < g; ++h) {
      const float* sh = scores + h * n + t;
      const float p0 = sh[0], p1 = t + 1 < n ? sh[1] : 0.f, p2 = t + 2 < n ? sh[2] : 0.f, p3 = t + 3 < n ? sh[3] : 0.f;
      float* oh = out + h * d;
#pragma omp simd
      for (int64_t j = 0; j < d; ++j) oh[j] += p0 * r0[j] + p1 * r1[j] + p2 * r2[j] + p3 * r3[j];
    }
  }
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
