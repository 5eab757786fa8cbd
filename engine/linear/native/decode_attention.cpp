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
#include <memory>
#include <type_traits>
#include <vector>

#include "amx.h"
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

// A row's result for one query head from its chunks' partials: block(c) is chunk c's, which holds `lanes` maxima,
// then `lanes` sums of weights, then `lanes` runs of d weighted values; the head is lane i. Each chunk is rescaled
// to the largest maximum, in chunk order: the same bits whichever kernel filled the blocks in that layout.
template <typename T, typename Block>
void merge_chunks(int64_t chunks, Block block, int64_t lanes, int64_t i, int64_t d, std::vector<float>& acc, T* dst) {
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t c = 0; c < chunks; ++c) top = std::max(top, block(c)[i]);
  std::fill(acc.begin(), acc.end(), 0.f);
  float sum = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    const float* p = block(c);
    const float weight = std::exp(p[i] - top);
    sum += weight * p[lanes + i];
    for (int64_t j = 0; j < d; ++j) acc[j] += weight * p[2 * lanes + i * d + j];
  }
  for (int64_t j = 0; j < d; ++j) dst[j] = static_cast<T>(acc[j] / sum);
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define KVSERVE_AMX_ATTENTION 1

// With AMX (bfloat16 keys and values, no window, d a multiple of 32 up to 128, g <= 16): the rows of one slot side by
// side in a step (a request's newest token and its drafts) share each key and value tile. A unit is up to 16 / g such
// rows, whose g·rows queries are the 16 rows of every tile product: scores (queries x keys) = Q·Kᵀ, each 16 keys'
// pairs transposed into AMX's B operand; each query's weights rounded to bfloat16; then (queries x d) = P·V, V's rows
// interleaved in pairs. A query's keys past its own position score −∞ and weigh 0, and the chunks lie at fixed
// multiples of kChunk keys, so a row's sums run in the same order whichever rows share its unit: a verified draft's
// row is the row decoded alone at its position, bit for bit. Its arithmetic per key is the same for 1 query or 16,
// where the vector path's grows with them: 2.5x faster at 5 rows of a slot, about as fast at 1.
constexpr int64_t kLanes = 16;  // queries a tile product takes, and keys per scores tile
constexpr int64_t kPair = 32;   // keys per values product: AMX's bfloat16 depth

struct alignas(64) AttentionTiles {  // every tile 16 rows of 64 bytes
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
  AttentionTiles() {
    for (int t = 0; t < 8; ++t) bytes_per_row[t] = 64, rows[t] = kLanes;
  }
};

// 16 vectors of 16 dwords, transposed in place: r[i] lane j <- r[j] lane i.
inline void transpose16(__m512i (&r)[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {  // within 128-bit lanes: pairs of rows interleaved
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int k = 0; k < 16; k += 4) {  // u[k + j], 128-bit lane L: column 4L + j of rows k..k+3
    u[k] = _mm512_unpacklo_epi64(t[k], t[k + 2]);
    u[k + 1] = _mm512_unpackhi_epi64(t[k], t[k + 2]);
    u[k + 2] = _mm512_unpacklo_epi64(t[k + 1], t[k + 3]);
    u[k + 3] = _mm512_unpackhi_epi64(t[k + 1], t[k + 3]);
  }
  for (int j = 0; j < 4; ++j) {  // row 4L + j: lane L of u[j], u[4 + j], u[8 + j], u[12 + j]
    const __m512i v0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x44), v1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xEE);
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x44), v3 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xEE);
    r[j] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    r[4 + j] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
    r[8 + j] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    r[12 + j] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
  }
}

// A thread's scratch for attend_chunk_amx.
struct AmxScratch {
  static constexpr int64_t kRow = kChunk + kPair;      // floats per query's row of scores
  alignas(64) at::BFloat16 queries[4][kLanes * 32];      // A operands, one a 32-wide slice of d: [query][32 of d]
  alignas(64) uint32_t keys[kLanes * kLanes];            // B operand: [pair of d][key], bfloat16 pairs
  alignas(64) float scores[kLanes * kRow];              // [query][key]: the scores, then the weights
  alignas(64) at::BFloat16 weights[kLanes * kPair];      // A operand: [query][32 keys]
  alignas(64) uint32_t values[4][kLanes * kLanes];      // B operands, one a 16-wide slice of d: [key pair][column]
  alignas(64) at::BFloat16 tail[2][kPair * 128];         // a chunk's last keys and values, zero past its end
  alignas(64) float out[4][kLanes * kLanes];            // C tiles: [query][column]
};

// Lane m's dword of a 32-bfloat16 vector [a₀..a₁₅ b₀..b₁₅] becomes (aₘ, bₘ): AMX's pairs.
inline __m512i interleave_halves(__m512i v) {
  const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(order, v);
}

// One chunk [begin, end) of one unit's K/V head (keys, values: the head's entries), for its M <= 16 queries (q[m]:
// d bfloat16; last[m]: the last entry query m sees; a chunk of fewer than kChunk keys is the unit's last, and ends
// past every query's last entry): as attend_chunk, each query's
// maximum score, sum of weights and Σ weight·v, into maximum[m], total[m] and out[m·d + j]. The tiles are
// configured by the caller (AttentionTiles). Per query, the keys run in vectors of 16 from `begin`, those past its
// own scoring −∞ and weighing 0, whatever the chunk's end: the same sums in the same order for any unit.
void attend_chunk_amx(AmxScratch& s, const at::BFloat16* keys, const at::BFloat16* values, int64_t begin, int64_t end,
                      const at::BFloat16* const* q, int M, const int32_t* last, int64_t d, float scale, float* maximum,
                      float* total, float* out) {
  const int64_t n = end - begin, slices = d / 32, stride = d * 2;
  const int64_t whole = n / kPair * kPair, padded = (n + kPair - 1) / kPair * kPair;
  if (whole < n) {  // the last keys and values from a copy padded with zeros: nothing past `end` is read
    for (int k = 0; k < 2; ++k) {
      std::memcpy(s.tail[k], (k ? values : keys) + (begin + whole) * d, (n - whole) * stride);
      std::memset(s.tail[k] + (n - whole) * d, 0, (padded - n) * stride);
    }
  }
  const auto key_rows = [&](int64_t t) { return t < whole ? keys + (begin + t) * d : s.tail[0] + (t - whole) * d; };
  const auto value_rows = [&](int64_t t) { return t < whole ? values + (begin + t) * d : s.tail[1] + (t - whole) * d; };

  std::memset(s.queries, 0, sizeof(s.queries));  // rows past M: zero queries, whose results are never read
  for (int m = 0; m < M; ++m)
    for (int64_t c = 0; c < slices; ++c) std::memcpy(s.queries[c] + m * 32, q[m] + 32 * c, 64);
  for (int64_t t = 0; t < padded; t += kLanes) {  // scores (16 queries, 16 keys) = Q·Kᵀ, 32 of d at a time
    const at::BFloat16* k = key_rows(t);
    _tile_zero(5);
    for (int64_t c = 0; c < slices; ++c) {
      __m512i rows[kLanes];  // key i's 16 pairs of this slice; transposed: pair i of every key (AMX's B)
      for (int64_t i = 0; i < kLanes; ++i) rows[i] = _mm512_loadu_si512(k + i * d + 32 * c);
      transpose16(rows);
      for (int64_t i = 0; i < kLanes; ++i) _mm512_store_si512(s.keys + i * kLanes, rows[i]);
      _tile_loadd(0, s.queries[c], 64);
      _tile_loadd(1, s.keys, 64);
      _tile_dpbf16ps(5, 0, 1);
    }
    _tile_stored(5, s.scores + t, AmxScratch::kRow * 4);
  }

  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512 none = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int m = 0; m < M; ++m) {
    float* row = s.scores + m * AmxScratch::kRow;
    const __m512i sees = _mm512_set1_epi32(last[m]);
    __m512 top = none;
    for (int64_t t = 0; t < padded; t += kLanes) {  // keys past the query's own (and past the chunk) score −∞
      const __mmask16 seen = _mm512_cmple_epi32_mask(_mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(begin + t)), lane), sees);
      const __m512 x = _mm512_mask_mul_ps(none, seen, _mm512_loadu_ps(row + t), _mm512_set1_ps(scale));
      _mm512_storeu_ps(row + t, x);
      top = _mm512_max_ps(top, x);
    }
    const float most = _mm512_reduce_max_ps(top);
    maximum[m] = most;
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < padded; t += kLanes) {  // weights rounded to bfloat16, as the values product takes them
      const __m512 x = _mm512_loadu_ps(row + t);
      const __mmask16 seen = _mm512_cmp_ps_mask(x, none, _CMP_NEQ_OQ);
      const __m512 w = _mm512_maskz_mov_ps(seen, exp_nonpositive<Lanes16>(_mm512_sub_ps(x, _mm512_set1_ps(most))));
      const __m512 rounded = _mm512_castsi512_ps(
          _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(w)), 16));
      _mm512_storeu_ps(row + t, rounded);
      sum = _mm512_add_ps(sum, rounded);
    }
    total[m] = _mm512_reduce_add_ps(sum);
  }

  std::memset(s.weights, 0, sizeof(s.weights));  // rows past M weigh nothing
  for (int64_t pass = 0; pass < d; pass += 64) {  // (16 queries, up to 64 of d) = P·V in C tiles 4..7
    const int64_t columns = std::min<int64_t>(4, (d - pass) / 16);
    _tile_zero(4);
    if (columns > 1) _tile_zero(5);
    if (columns > 2) _tile_zero(6);
    if (columns > 3) _tile_zero(7);
    for (int64_t t = 0; t < padded; t += kPair) {
      for (int m = 0; m < M; ++m) {  // query m's weights of keys t..t + 31, in order: AMX's A
        const float* w = s.scores + m * AmxScratch::kRow + t;
        _mm512_store_si512(s.weights + m * kPair, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(w + 16), _mm512_loadu_ps(w)));
      }
      for (int64_t j = 0; j < columns; ++j)
        for (int64_t i = 0; i < kLanes; ++i) {  // key pair i, columns pass + 16j..: (v[2i][c], v[2i + 1][c])
          const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(value_rows(t + 2 * i) + pass + 16 * j));
          const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(value_rows(t + 2 * i + 1) + pass + 16 * j));
          _mm512_store_si512(s.values[j] + i * kLanes, interleave_halves(_mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1)));
        }
      _tile_loadd(0, s.weights, 64);
      _tile_loadd(1, s.values[0], 64);
      _tile_dpbf16ps(4, 0, 1);
      if (columns > 1) {
        _tile_loadd(2, s.values[1], 64);
        _tile_dpbf16ps(5, 0, 2);
      }
      if (columns > 2) {
        _tile_loadd(3, s.values[2], 64);
        _tile_dpbf16ps(6, 0, 3);
      }
      if (columns > 3) {
        _tile_loadd(1, s.values[3], 64);
        _tile_dpbf16ps(7, 0, 1);
      }
    }
    _tile_stored(4, s.out[0], 64);
    if (columns > 1) _tile_stored(5, s.out[1], 64);
    if (columns > 2) _tile_stored(6, s.out[2], 64);
    if (columns > 3) _tile_stored(7, s.out[3], 64);
    for (int m = 0; m < M; ++m)
      for (int64_t j = 0; j < columns; ++j) std::memcpy(out + m * d + pass + 16 * j, s.out[j] + m * kLanes, 64);
  }
}

// decode_attention by AMX tiles (above), window 0: every row sees entries 0..p of its slot.
at::Tensor attend_amx(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                      const at::Tensor& slot_index, const at::Tensor& positions) {
  const int64_t b = q.size(0), h_q = q.size(1), d = q.size(3);
  const int64_t h_kv = keys.size(1), capacity = keys.size(2), g = h_q / h_kv, per_unit = kLanes / g;
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  const int64_t* slot = slot_index.data_ptr<int64_t>();
  const int64_t* position = positions.data_ptr<int64_t>();
  for (int64_t r = 0; r < b; ++r)
    TORCH_CHECK(0 <= slot[r] && slot[r] < keys.size(0) && 0 <= position[r] && position[r] < capacity,
                "slot_index and positions must fall inside the cache");
  // Unit u: rows unit_first[u]..unit_first[u + 1] - 1, side by side in one slot; its tasks (chunk, K/V head) are
  // task_first[u].., chunk c reading entries c·kChunk up to the unit's furthest position.
  std::vector<int64_t> unit_first{0}, unit_of(b), task_first{0};
  for (int64_t r = 1; r < b; ++r)
    if (slot[r] != slot[r - 1] || r - unit_first.back() == per_unit) unit_first.push_back(r);
  unit_first.push_back(b);
  const int64_t units = static_cast<int64_t>(unit_first.size()) - 1;
  std::vector<int64_t> furthest(units), task_unit;
  for (int64_t u = 0; u < units; ++u) {
    furthest[u] = *std::max_element(position + unit_first[u], position + unit_first[u + 1]);
    for (int64_t r = unit_first[u]; r < unit_first[u + 1]; ++r) unit_of[r] = u;
    const int64_t tasks = (furthest[u] / kChunk + 1) * h_kv;
    task_first.push_back(task_first.back() + tasks);
    task_unit.insert(task_unit.end(), tasks, u);
  }
  const int64_t stride = 2 * kLanes + kLanes * d;  // per task: 16 maxima, 16 sums, 16·d weighted values
  std::vector<float> partial(task_first.back() * stride);
  const at::BFloat16* q_data = q.data_ptr<at::BFloat16>();
  const at::BFloat16* key_data = keys.data_ptr<at::BFloat16>();
  const at::BFloat16* value_data = values.data_ptr<at::BFloat16>();
  at::parallel_for(0, task_first.back(), 1, [&](int64_t lo, int64_t hi) {
    const std::unique_ptr<AmxScratch> scratch(new AmxScratch);  // left uninitialized: every read is written first
    const AttentionTiles config;
    _tile_loadconfig(&config);
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t u = task_unit[task], chunk = (task - task_first[u]) / h_kv, head = (task - task_first[u]) % h_kv;
      const at::BFloat16* query[kLanes];
      alignas(64) int32_t last[kLanes];
      int M = 0;
      for (int64_t r = unit_first[u]; r < unit_first[u + 1]; ++r)
        for (int64_t h = 0; h < g; ++h, ++M) {
          query[M] = q_data + r * q.stride(0) + (head * g + h) * q.stride(1);
          last[M] = static_cast<int32_t>(position[r]);
        }
      std::fill(last + M, last + kLanes, -1);
      const int64_t offset = (slot[unit_first[u]] * h_kv + head) * capacity * d;
      float* p = partial.data() + task * stride;
      attend_chunk_amx(*scratch, key_data + offset, value_data + offset, chunk * kChunk,
                       std::min((chunk + 1) * kChunk, furthest[u] + 1), query, M, last, d, scale, p, p + kLanes,
                       p + 2 * kLanes);
    }
    _tile_release();
  });
  at::Tensor out = at::empty({b, h_q, 1, d}, q.options());
  at::BFloat16* o = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, b * h_kv, b * h_kv, [&](int64_t lo, int64_t hi) {  // a few microseconds: one thread
    std::vector<float> acc(d);
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t r = task / h_kv, head = task % h_kv, u = unit_of[r], chunks = position[r] / kChunk + 1;
      const auto block = [&](int64_t c) { return partial.data() + (task_first[u] + c * h_kv + head) * stride; };
      for (int64_t h = 0; h < g; ++h)  // the row's own chunks (never those past its position); its lane in the unit
        merge_chunks(chunks, block, kLanes, (r - unit_first[u]) * g + h, d, acc, o + (r * h_q + head * g + h) * d);
    }
  });
  return out;
}
#endif

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
      const auto block = [&](int64_t c) { return partial.data() + ((first[r] + c) * h_kv + head) * stride; };
      for (int64_t h = 0; h < g; ++h)
        merge_chunks(first[r + 1] - first[r], block, g, h, d, acc, o + (r * h_q + head * g + h) * d);
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
  if (keys.scalar_type() == at::kBFloat16) {
#if defined(KVSERVE_AMX_ATTENTION)
    // A property of the layer and the CPU alone, never of the rows: each row gets one kernel's bits at every step.
    const int64_t g = q.size(1) / keys.size(1);
    if (window == 0 && q.size(3) % 32 == 0 && q.size(3) <= 128 && g <= kLanes && amx_permitted())
      return attend_amx(q, keys, values, slot_index, positions);
#endif
    return attend<at::BFloat16, at::BFloat16>(q, keys, values, slot_index, positions, window);
  }
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
