// What the 4-bit and 8-bit group-code products share: the inputs quantized to 8 bits per group of 32, and the
// loop that runs a tile kernel over every 16-row tile of the weight (split over torch's threads: tile_shares.h) and
// every input row (in passes of up to kRowsPerPass rows that share one load of the tile's codes; with AMX's integer
// tiles, of up to 16 rows whose products with a group are one tile product). With AMX's bfloat16 tiles, for many
// input rows, the weights are instead dequantized to bfloat16 once per call and multiplied by the inputs in bfloat16.
// The caller says from how many rows each form runs (measured for the CPU at load: engine/linear/timing.py).
//
// A product's result with integer codes: Σ_i w_i·x_i with w_i = s·q_i + m per group, computed as
//   s·d·Σ (q_i - c)·x̂_i + (m + c·s)·Σ x_i,   x_i ≈ d·x̂_i,  c the codes' centre (8 or 128),
// so that the rounding error of x̂ meets centred codes, and the rest of each weight meets the exact sum of x.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "tile_shares.h"

#if !defined(__AVX2__) || !defined(__F16C__) || !defined(__FMA__)
#error "kvserve's group-code products need AVX2, FMA and F16C"
#endif

namespace kvserve {

constexpr int64_t kGroup = 32;
constexpr int64_t kTile = 16;  // output rows per tile
// Input rows per pass over a tile's codes, at most: as many as the registers hold a sum for beside the tile's 8
// operands and its scales. A row's sums are its own in any pass: its bits never depend on the pass.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int kRowsPerPass = 8;  // 32 registers: a sum per row (one register), the tile's 8 operands
#else
constexpr int kRowsPerPass = 4;  // 16 registers: a tile's two parts take two sums per row
#endif

// One pass over `rows` rows (1..kMost) from `row`: pass(rows, row), rows a std::integral_constant, so that each
// pass's row count is a template argument (its sums live in registers).
template <int kMost, typename Pass>
inline void one_pass(int64_t rows, int64_t row, Pass& pass) {
  if constexpr (kMost > 0) {
    if (rows == kMost) return pass(std::integral_constant<int, kMost>{}, row);
    one_pass<kMost - 1>(rows, row, pass);
  }
}

// Rows [row, m) in as few passes as kMost rows a pass allow, their sizes as even as they can be: 5 rows in one
// pass of 5 (a verifying step's 1 + 4), 9 in 5 and 4, not a pass of 1 that decodes every code again for one row.
template <int kMost, typename Pass>
inline void in_passes(int64_t row, int64_t m, Pass&& pass) {
  const int64_t rows = m - row, passes = (rows + kMost - 1) / kMost;
  for (int64_t p = 0; p < passes; ++p) {
    const int64_t size = rows / passes + (p < rows % passes);
    one_pass<kMost>(size, row, pass);
    row += size;
  }
}

// Inputs 16 at a time, as float32 (bfloat16 widened: it is float32's upper half): what the input rows' quantization
// (QuantizedRows, QuantizedSuperBlocks) is made of. round_codes() gives nearbyint's codes (MXCSR's mode: nearest, ties to
// even) of the same float products, so the codes are the scalar loop's bits; sums of floats go in a fixed order, so
// a row's are the same whatever rows come with it.
namespace sixteen {
#if defined(__AVX512F__) && defined(__AVX512BW__)
using Sixteen = __m512;  // 16 inputs as float32
inline Sixteen zero() { return _mm512_setzero_ps(); }
inline Sixteen load(const float* p) { return _mm512_loadu_ps(p); }
inline Sixteen load(const at::BFloat16* p) {  // bfloat16 is float32's upper half
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline Sixteen max_abs(Sixteen most, Sixteen v) { return _mm512_max_ps(most, _mm512_abs_ps(v)); }
inline float largest_of(Sixteen v) { return _mm512_reduce_max_ps(v); }
inline float sum_of(Sixteen v) { return _mm512_reduce_add_ps(v); }
inline Sixteen add(Sixteen a, Sixteen b) { return _mm512_add_ps(a, b); }
// The 16 codes of v·inverse into out; returns their sum.
inline int32_t round_codes(Sixteen v, float inverse, int8_t* out) {
  const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v, _mm512_set1_ps(inverse)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(q));
  return _mm512_reduce_add_epi32(q);
}
#else
struct Sixteen { __m256 low, high; };
inline Sixteen zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Sixteen load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline __m256 widen(const at::BFloat16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline Sixteen load(const at::BFloat16* p) { return {widen(p), widen(p + 8)}; }
inline __m256 abs8(__m256 v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), v); }
inline Sixteen max_abs(Sixteen most, Sixteen v) {
  return {_mm256_max_ps(most.low, abs8(v.low)), _mm256_max_ps(most.high, abs8(v.high))};
}
inline float largest_of(Sixteen v) {
  __m256 m = _mm256_max_ps(v.low, v.high);
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
}
inline float sum_of(Sixteen v) {
  const __m256 m = _mm256_add_ps(v.low, v.high);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
}
inline Sixteen add(Sixteen a, Sixteen b) { return {_mm256_add_ps(a.low, b.low), _mm256_add_ps(a.high, b.high)}; }
inline int32_t round_codes(Sixteen v, float inverse, int8_t* out) {
  const __m256 k = _mm256_set1_ps(inverse);
  const __m256i low = _mm256_cvtps_epi32(_mm256_mul_ps(v.low, k)), high = _mm256_cvtps_epi32(_mm256_mul_ps(v.high, k));
  const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(low, high), 0xD8);  // 16 int16 in order
  const __m128i bytes = _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), bytes);
  const __m256i pairs = _mm256_madd_epi16(words, _mm256_set1_epi16(1));
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(pairs), _mm256_extracti128_si256(pairs, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1)));
}
#endif
}  // namespace sixteen

// The input rows, group by group: 8-bit codes x̂, their scale d, the exact sum Σ x and c·Σ x̂.
struct QuantizedRows {
  std::vector<int8_t> codes;  // (m, in)
  std::vector<float> scale, sum;  // (m, groups)
  std::vector<int32_t> centred_sum;  // (m, groups)

  // rows: (m, in) float32 or bfloat16, contiguous.
  QuantizedRows(const at::Tensor& rows, int32_t centre)
      : codes(rows.numel()), scale(rows.numel() / kGroup), sum(rows.numel() / kGroup), centred_sum(rows.numel() / kGroup) {
    if (rows.scalar_type() == at::kBFloat16) quantize(rows.data_ptr<at::BFloat16>(), centre);
    else quantize(rows.data_ptr<float>(), centre);
  }

  template <typename T>
  void quantize(const T* x, int32_t centre) {
    using namespace sixteen;
    for (size_t i = 0; i < scale.size(); ++i) {
      const Sixteen low = load(x + i * kGroup), high = load(x + i * kGroup + 16);
      const float largest = largest_of(max_abs(max_abs(zero(), low), high));
      const float inverse = largest > 0 ? 127.f / largest : 0.f;
      const int32_t code_sum = round_codes(low, inverse, codes.data() + i * kGroup) + round_codes(high, inverse, codes.data() + i * kGroup + 16);
      scale[i] = largest / 127.f, sum[i] = sum_of(add(low, high)), centred_sum[i] = centre * code_sum;
    }
  }
};

// How far ahead of the codes being multiplied the products (run_tile, and the K-quants' in super_block.h) fetch their
// lines into cache: the hardware's prefetch alone leaves one thread's stream of codes short of the machine's read rate.
// A core's share of a server's read rate times the memory's latency (tens of GB/s times 100-200 ns: a few KB) is enough
// lines in flight; further ahead only fills the L1 with lines not needed yet, beside the input rows' codes that every
// tile reads again, and leaves more of each share's start to the hardware alone. 16 KB ahead, against this, left whole
// decode steps 2-10% slower (1B Q4_K_M, Q4_0 and SmolLM2, one process alternating the two: bench/README.md, session
// 49), where the products called alone, back to back, could not tell them apart.
constexpr int64_t kPrefetchBytes = 4 * 1024;

// The cache lines of [p, p + bytes), fetched ahead of their use (prefetches past the end of a buffer fault nothing).
inline void prefetch(const uint8_t* p, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(reinterpret_cast<const char*>(p + line), _MM_HINT_T0);
}

inline int32_t four_codes(const int8_t* p) {  // 4 input codes as one broadcastable dword
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// A tile's scale s and minimum m per (group, output row), float16 as GGUF stores them, (groups, 16) per tile.
// load(scales, g, part, s, m) gives group g's for the tile's rows in register `part` (16 rows: all of them in one
// AVX-512 register; two parts of 8 with AVX2).
// - HalfScales: both (Q4_1, Q5_1, and codes fitted at load);
// - CentredScales: the scale alone, where m = −centre·s (Q4_0, Q5_0 and Q8_0: w = s·(q − centre)): the rest of each
//   weight, centre·s + m, is nothing, so no minimums are held, read or multiplied.
struct HalfScales {
  const at::Half* scale;
  const at::Half* minimum;
  static constexpr bool kCentred = false;
};

struct CentredScales {
  const at::Half* scale;
  static constexpr bool kCentred = true;
};

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)

using Operand = __m512i;  // 64 code bytes: 4 inputs of each of a tile's 16 rows
constexpr int kParts = 1;  // registers per tile

// One part of a tile (all of it here), R input rows from `row`: y[r·out + 0..15] = the product, group by group.
// Codes::operands(bytes, part, w) gives the group's 8 operands, w[k] = the codes of inputs 4k..4k+3.
inline void load(const HalfScales& scales, int64_t g, int, __m512& s, __m512& m) {
  s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales.scale + g * kTile)));
  m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales.minimum + g * kTile)));
}

inline void load(const CentredScales& scales, int64_t g, int, __m512& s, __m512& m) {
  s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales.scale + g * kTile)));
  m = _mm512_setzero_ps();  // unused: a centred group has no rest
}

// start + Σ_k w[k]·(inputs 4k..4k+3) over a group for 16 output rows, in int32 (exact, so in any order): vpdpbusd,
// unsigned codes · signed inputs, 4 at a time. For one row in two chains (summed) that halve its latency; in a pass of
// R > 1 rows, one chain a row, the rows' chains side by side (an addition fewer per row).
template <int R>
inline __m512i group_dots(__m512i start, const Operand (&w)[8], const int8_t* codes) {
  if constexpr (R == 1) {
    __m512i odd = _mm512_setzero_si512();
    for (int k = 0; k < 8; k += 2) {
      start = _mm512_dpbusd_epi32(start, w[k], _mm512_set1_epi32(four_codes(codes + 4 * k)));
      odd = _mm512_dpbusd_epi32(odd, w[k + 1], _mm512_set1_epi32(four_codes(codes + 4 * k + 4)));
    }
    return _mm512_add_epi32(start, odd);
  }
  for (int k = 0; k < 8; ++k) start = _mm512_dpbusd_epi32(start, w[k], _mm512_set1_epi32(four_codes(codes + 4 * k)));
  return start;
}

template <typename Codes, int R, typename Scales>
void run_tile(const uint8_t* packed, const Scales& scales, int64_t groups, const QuantizedRows& x, int64_t row,
              int64_t in, float* y, int64_t out) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* group = packed + g * Codes::kTileGroupBytes;
    prefetch(group + kPrefetchBytes, Codes::kTileGroupBytes);
    Operand w[8];
    Codes::operands(group, 0, w);
    __m512 s, minimum;
    load(scales, g, 0, s, minimum);
    const __m512 rest = _mm512_fmadd_ps(_mm512_set1_ps(static_cast<float>(Codes::kCentre)), s, minimum);
    for (int r = 0; r < R; ++r) {
      const int64_t rg = (row + r) * groups + g;
      const int8_t* codes = x.codes.data() + (row + r) * in + g * kGroup;
      // Σ (q − c)·x̂: the dot products added to −c·Σ x̂
      const __m512i centred = group_dots<R>(_mm512_set1_epi32(-x.centred_sum[rg]), w, codes);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(centred), _mm512_mul_ps(s, _mm512_set1_ps(x.scale[rg])), acc[r]);
      if constexpr (!Scales::kCentred) acc[r] = _mm512_fmadd_ps(rest, _mm512_set1_ps(x.sum[rg]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * out, acc[r]);
}

#else  // AVX2: a tile is two parts of 8 rows; vpmaddubsw + vpmaddwd stand for vpdpbusd

using Operand = __m256i;  // 32 code bytes: 4 inputs of each of 8 rows
constexpr int kParts = 2;

// acc + Σ over 4-byte lanes of (q - centre)·x̂: vpmaddubsw multiplies unsigned by signed bytes, so |q - centre|
// meets x̂ carrying the sign of q - centre (|q - centre| <= 128, |x̂| <= 127: a pair's sum fits in int16).
template <int32_t kCentre>
inline __m256i dot_centred(__m256i acc, __m256i q, __m256i x) {
  const __m256i centred = _mm256_sub_epi8(q, _mm256_set1_epi8(static_cast<char>(kCentre)));  // as int8, wrapping
  const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(centred), _mm256_sign_epi8(x, centred));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

// Σ_k (Σ of Codes::kInt16Terms pairs q·x̂ in int16)·weight over a group, in int32, for each of 8 rows: codes of up to 6
// bits meet x̂ unsigned (vpmaddubsw: a pair's sum is at most 2·63·127, kInt16Terms of them fit in int16), and vpmaddwd
// multiplies the int16 sums by `weight`'s two int16 per row (1 for the plain sum, a group's scale in super-blocks).
template <typename Codes>
inline __m256i pair_sums(const __m256i (&w)[8], const int8_t* codes, __m256i weight) {
  __m256i total = _mm256_setzero_si256();
  for (int k0 = 0; k0 < 8; k0 += Codes::kInt16Terms) {
    __m256i pairs = _mm256_maddubs_epi16(w[k0], _mm256_set1_epi32(four_codes(codes + 4 * k0)));
    for (int k = k0 + 1; k < k0 + Codes::kInt16Terms; ++k)
      pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(w[k], _mm256_set1_epi32(four_codes(codes + 4 * k))));
    total = _mm256_add_epi32(total, _mm256_madd_epi16(pairs, weight));
  }
  return total;
}

// Σ (q − centre)·x̂ over a group, for each of 8 rows: codes of up to 6 bits meet x̂ unsigned (vpmaddubsw: a pair's
// sum is at most 2·63·127) and Codes::kInt16Terms such pairs add up in int16 before one vpmaddwd widens them, then
// centre·Σ x̂ (centred_sum) comes off; 8-bit codes take dot_centred's signs instead (2·255·127 would saturate).
template <typename Codes>
inline __m256i group_dot(const __m256i (&w)[8], const int8_t* codes, int32_t centred_sum) {
  if constexpr (Codes::kInt16Terms > 0) {
    return _mm256_sub_epi32(pair_sums<Codes>(w, codes, _mm256_set1_epi16(1)), _mm256_set1_epi32(centred_sum));
  } else {
    __m256i total = _mm256_setzero_si256(), odd = _mm256_setzero_si256();  // two chains: half the latency
    for (int k = 0; k < 8; k += 2) {
      total = dot_centred<Codes::kCentre>(total, w[k], _mm256_set1_epi32(four_codes(codes + 4 * k)));
      odd = dot_centred<Codes::kCentre>(odd, w[k + 1], _mm256_set1_epi32(four_codes(codes + 4 * k + 4)));
    }
    return _mm256_add_epi32(total, odd);  // centred already, byte by byte
  }
}

inline void load(const HalfScales& scales, int64_t g, int part, __m256& s, __m256& m) {
  const int64_t lanes = g * kTile + 8 * part;
  s = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales.scale + lanes)));
  m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales.minimum + lanes)));
}

inline void load(const CentredScales& scales, int64_t g, int part, __m256& s, __m256& m) {
  s = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales.scale + g * kTile + 8 * part)));
  m = _mm256_setzero_ps();  // unused: a centred group has no rest
}

template <typename Codes, int R, typename Scales>
void run_tile(const uint8_t* packed, const Scales& scales, int64_t groups, const QuantizedRows& x, int64_t row,
              int64_t in, float* y, int64_t out) {
  __m256 acc[kParts][R];
  for (int part = 0; part < kParts; ++part)
    for (int r = 0; r < R; ++r) acc[part][r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* group = packed + g * Codes::kTileGroupBytes;
    prefetch(group + kPrefetchBytes, Codes::kTileGroupBytes);
    for (int part = 0; part < kParts; ++part) {  // both parts while the group's lines are in cache
      Operand w[8];
      Codes::operands(group, part, w);
      __m256 s, minimum;
      load(scales, g, part, s, minimum);
      const __m256 rest = _mm256_fmadd_ps(_mm256_set1_ps(static_cast<float>(Codes::kCentre)), s, minimum);
      for (int r = 0; r < R; ++r) {
        const int64_t rg = (row + r) * groups + g;
        const int8_t* codes = x.codes.data() + (row + r) * in + g * kGroup;
        const __m256i centred = group_dot<Codes>(w, codes, x.centred_sum[rg]);
        __m256& a = acc[part][r];
        a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(centred), _mm256_mul_ps(s, _mm256_set1_ps(x.scale[rg])), a);
        if constexpr (!Scales::kCentred) a = _mm256_fmadd_ps(rest, _mm256_set1_ps(x.sum[rg]), a);
      }
    }
  }
  for (int part = 0; part < kParts; ++part)
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * out + 8 * part, acc[part][r]);
}

#endif

// 4-bit codes (codes4_product.cpp's layout, also Q4_K's: superblock4_product.cpp), centred on 8.
struct Codes4Tile {
  static constexpr int64_t kTileGroupBytes = kTile * kGroup / 2;
  static constexpr int32_t kCentre = 8;
  static constexpr int kInt16Terms = 8;  // 8 · 2·15·127 < 2^15

  // Run k's low nibbles are inputs 8k..8k+3, its high ones 8k+4..8k+7: operands 2k and 2k + 1.
  static void operands(const uint8_t* bytes, int part, Operand (&w)[8]) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    const Operand low_nibbles = _mm512_set1_epi8(0x0F);
    for (int k = 0; k < 4; ++k) {
      const Operand run = _mm512_loadu_si512(bytes + 64 * k);
      w[2 * k] = _mm512_and_si512(run, low_nibbles);
      w[2 * k + 1] = _mm512_and_si512(_mm512_srli_epi16(run, 4), low_nibbles);
    }
#else
    const Operand low_nibbles = _mm256_set1_epi8(0x0F);
    for (int k = 0; k < 4; ++k) {
      const Operand run = _mm256_loadu_si256(reinterpret_cast<const Operand*>(bytes + 64 * k + 32 * part));
      w[2 * k] = _mm256_and_si256(run, low_nibbles);
      w[2 * k + 1] = _mm256_and_si256(_mm256_srli_epi16(run, 4), low_nibbles);
    }
#endif
  }
};

// 5-bit codes (Q5_0, Q5_1, and Q5_K's: codes5_product.cpp, superblock5_product.cpp), centred on 16: the low 4 bits
// as Codes4Tile packs them (256 bytes per tile and group), then the fifth bits, 16 bytes per run of 64: byte c of
// run k holds in bits 2t and 2t + 1 the fifth bits of run byte c + 16t (its low nibble's input, its high one's).
struct Codes5Tile {
  static constexpr int64_t kTileGroupBytes = kTile * kGroup / 2 + kTile * kGroup / 8;
  static constexpr int32_t kCentre = 16;
  static constexpr int kInt16Terms = 4;  // 4 · 2·31·127 < 2^15

  static void operands(const uint8_t* bytes, int part, Operand (&w)[8]) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    const Operand nibble = _mm512_set1_epi8(0x0F), one = _mm512_set1_epi8(0x01), two = _mm512_set1_epi8(0x02);
    const Operand shifts = _mm512_set_epi32(6, 6, 6, 6, 4, 4, 4, 4, 2, 2, 2, 2, 0, 0, 0, 0);  // 16-byte lane t: 2t
    for (int k = 0; k < 4; ++k) {
      const Operand run = _mm512_loadu_si512(bytes + 64 * k);
      const Operand fifth = _mm512_srlv_epi32(
          _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 256 + 16 * k))), shifts);
      w[2 * k] = _mm512_or_si512(_mm512_and_si512(run, nibble), _mm512_slli_epi16(_mm512_and_si512(fifth, one), 4));
      w[2 * k + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(run, 4), nibble),
                                     _mm512_slli_epi16(_mm512_and_si512(fifth, two), 3));
    }
#else
    const Operand nibble = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(0x01), two = _mm256_set1_epi8(0x02);
    // part p holds run bytes 32p..32p+31: 16-byte lanes t = 2p and 2p + 1
    const Operand shifts = _mm256_set_epi32(4 * part + 2, 4 * part + 2, 4 * part + 2, 4 * part + 2,
                                            4 * part, 4 * part, 4 * part, 4 * part);
    for (int k = 0; k < 4; ++k) {
      const Operand run = _mm256_loadu_si256(reinterpret_cast<const Operand*>(bytes + 64 * k + 32 * part));
      const Operand fifth = _mm256_srlv_epi32(
          _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 256 + 16 * k))), shifts);
      w[2 * k] = _mm256_or_si256(_mm256_and_si256(run, nibble), _mm256_slli_epi16(_mm256_and_si256(fifth, one), 4));
      w[2 * k + 1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(run, 4), nibble),
                                     _mm256_slli_epi16(_mm256_and_si256(fifth, two), 3));
    }
#endif
  }
};

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define KVSERVE_AMX 1

constexpr int kAmxRows = 16;  // input rows per tile product: the most an AMX tile holds

// Tiles: 0 and 1 = `rows` input rows' 32 codes of a group (A, signed); 2 and 3 = a group's 8 weight operands, each
// 4 inputs of 16 output rows, which is AMX's layout for B (unsigned); 4..7 = (rows, 16) int32 dot products of 4
// groups in a row, so that the tile unit's loads and stores of one group overlap another's.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};

  explicit TileConfig(int input_rows) {
    for (int t = 0; t < 2; ++t) bytes_per_row[t] = kGroup, rows[t] = input_rows;
    for (int t = 2; t < 4; ++t) bytes_per_row[t] = 64, rows[t] = kGroup / 4;
    for (int t = 4; t < 8; ++t) bytes_per_row[t] = kTile * 4, rows[t] = input_rows;
  }

  // Half groups' integer tiles (Q6_K's sub-blocks of 16 inputs): 0, 1 = 16 input rows' 16 codes (A); 2, 3 = a half
  // group's 4 weight operands (B); 4..7 = (16, 16) int32 dot products.
  static TileConfig halves() {
    TileConfig config(kAmxRows);
    for (int t = 0; t < 2; ++t) config.bytes_per_row[t] = kGroup / 2;
    for (int t = 2; t < 4; ++t) config.rows[t] = kGroup / 8;
    return config;
  }

  // The bfloat16 tiles' (bf16_block): 0, 1 inputs, 2, 3 weights, 4..7 float32 sums, each 16 rows of 64 bytes.
  static TileConfig bfloat16() {
    TileConfig config(kAmxRows);
    for (int t = 0; t < 8; ++t) config.bytes_per_row[t] = 64, config.rows[t] = kAmxRows;
    return config;
  }
};

constexpr int kAmxGroups = 4;  // groups per pass: one dot-product tile each

// Dot products of groups g..g+n-1 (n <= 4) into dots[i] (rows, 16): tdpbsud, signed inputs times unsigned codes.
template <typename Codes>
inline void amx_dots(const uint8_t* packed, const int8_t* inputs, int64_t in, int64_t g, int n,
                     uint8_t (*weights)[8 * 64], int32_t (*dots)[kAmxRows * kTile]) {
  for (int i = 0; i < n; ++i) {
    Operand w[8];
    Codes::operands(packed + (g + i) * Codes::kTileGroupBytes, 0, w);
    for (int k = 0; k < 8; ++k) _mm512_store_si512(weights[i] + 64 * k, w[k]);
  }
#define KVSERVE_AMX_GROUP(i, a, b, c)                                      \
  if (i < n) {                                                            \
    _tile_zero(c);                                                        \
    _tile_loadd(a, inputs + (g + i) * kGroup, in);                        \
    _tile_loadd(b, weights[i], 64);                                       \
    _tile_dpbsud(c, a, b);                                                \
  }
  KVSERVE_AMX_GROUP(0, 0, 2, 4)
  KVSERVE_AMX_GROUP(1, 1, 3, 5)
  KVSERVE_AMX_GROUP(2, 0, 2, 6)
  KVSERVE_AMX_GROUP(3, 1, 3, 7)
#undef KVSERVE_AMX_GROUP
  _tile_stored(4, dots[0], kTile * 4);  // tiles past n hold nothing that is read
  if (n > 1) _tile_stored(5, dots[1], kTile * 4);
  if (n > 2) _tile_stored(6, dots[2], kTile * 4);
  if (n > 3) _tile_stored(7, dots[3], kTile * 4);
}

// run_tile for R <= 16 input rows from `row`, the tile's configuration loaded for R: per
// group, one tdpbsud gives every row's Σ x̂·q for the 16 output rows; the rest is run_tile's, row by row.
template <typename Codes>
void run_tile_amx(const uint8_t* packed, const at::Half* scale, const at::Half* minimum, int64_t groups,
                  const QuantizedRows& x, int64_t row, int R, int64_t in, float* y, int64_t out) {
  __m512 acc[kAmxRows];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  alignas(64) uint8_t weights[kAmxGroups][8 * 64];
  alignas(64) int32_t dots[kAmxGroups][kAmxRows * kTile];
  for (int64_t g0 = 0; g0 < groups; g0 += kAmxGroups) {
    const int n = static_cast<int>(std::min<int64_t>(kAmxGroups, groups - g0));
    amx_dots<Codes>(packed, x.codes.data() + row * in, in, g0, n, weights, dots);
    for (int i = 0; i < n; ++i) {
      const int64_t g = g0 + i;
      const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scale + g * kTile)));
      const __m512 rest = minimum == nullptr ? _mm512_setzero_ps() :  // centred: no minimums (CentredScales)
          _mm512_fmadd_ps(_mm512_set1_ps(static_cast<float>(Codes::kCentre)), s,
                          _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(minimum + g * kTile))));
      for (int r = 0; r < R; ++r) {
        const int64_t rg = (row + r) * groups + g;
        const __m512i centred = _mm512_sub_epi32(_mm512_load_si512(dots[i] + r * kTile),
                                                 _mm512_set1_epi32(x.centred_sum[rg]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(centred), _mm512_mul_ps(s, _mm512_set1_ps(x.scale[rg])), acc[r]);
        acc[r] = _mm512_fmadd_ps(rest, _mm512_set1_ps(x.sum[rg]), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * out, acc[r]);
}

// Every input row against tiles [begin, end), 16 rows per tile product.
template <typename Codes>
void run_tiles_amx(const uint8_t* codes, const at::Half* scales, const at::Half* minimums, int64_t groups,
                   const QuantizedRows& x, int64_t m, int64_t in, float* y, int64_t padded, int64_t begin, int64_t end) {
  for (int64_t r = 0; r < m; r += kAmxRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kAmxRows, m - r));
    const TileConfig config(rows);
    _tile_loadconfig(&config);  // per thread, as torch's threads run these tiles
    for (int64_t t = begin; t < end; ++t)
      run_tile_amx<Codes>(codes + t * groups * Codes::kTileGroupBytes, scales + t * groups * kTile,
                          minimums == nullptr ? nullptr : minimums + t * groups * kTile, groups, x, r, rows, in,
                          y + r * padded + t * kTile, padded);
  }
  _tile_release();
}

#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define KVSERVE_AMX_BF16 1

// For many input rows, the weights are dequantized once per call into bfloat16 tiles and multiplied by the inputs
// in bfloat16 (tdpbf16ps, float32 sums): the per-group scaling that the integer tiles need for every 16 input rows
// is done once per weight instead, and the sums run over all groups in the tile registers.
constexpr int kBf16Group = kTile * kGroup;  // bfloat16 values of one tile's group: AMX's B operand, 16 rows of 64 bytes
constexpr int64_t kBf16BlockBytes = 64 * 1024;  // B operands dequantized at a time, per thread

// AMX's B operand of a tile's group: row p holds, for output row o at values 2o and 2o + 1, the weights of inputs 2p
// and 2p + 1, w = s·q + m rounded to bfloat16.
template <typename Codes>
inline void dequantize_group(const uint8_t* bytes, const at::Half* scale, const at::Half* minimum, uint16_t* b) {
  Operand w[8];
  Codes::operands(bytes, 0, w);
  const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scale)));
  const __m512 m = minimum == nullptr  // centred: m = −centre·s (CentredScales)
                       ? _mm512_mul_ps(s, _mm512_set1_ps(-static_cast<float>(Codes::kCentre)))
                       : _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(minimum)));
  const __m512i byte = _mm512_set1_epi32(0xFF);
  // values 0..15 are one input's 16 outputs, 16..31 the next input's: value 2o <- o, 2o + 1 <- 16 + o
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                         23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int k = 0; k < 8; ++k) {  // w[k]: inputs 4k..4k+3, one byte each per output row
    __m512 v[4];
    v[0] = _mm512_cvtepi32_ps(_mm512_and_si512(w[k], byte));
    v[1] = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(w[k], 8), byte));
    v[2] = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(w[k], 16), byte));
    v[3] = _mm512_cvtepi32_ps(_mm512_srli_epi32(w[k], 24));
    for (int j = 0; j < 4; ++j) v[j] = _mm512_fmadd_ps(s, v[j], m);
    for (int h = 0; h < 2; ++h) {  // B row 2k + h: inputs 4k + 2h and 4k + 2h + 1
      const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(v[2 * h + 1], v[2 * h]));
      _mm512_storeu_si512(b + (2 * k + h) * 32, _mm512_permutexvar_epi16(pairs, both));
    }
  }
}

// C tiles 4 + 2i + j = A tile i (input rows 16i..16i+15 from `a`) · B tile j (output tile j's groups in `b[j]`),
// summed over all groups, stored to y (row stride `out`).
template <int kA, int kB>
void bf16_block(const uint16_t* a, int64_t in, const uint16_t* const* b, int64_t groups, float* y, int64_t out) {
  _tile_zero(4);
  if constexpr (kB > 1) _tile_zero(5);
  if constexpr (kA > 1) _tile_zero(6);
  if constexpr (kA > 1 && kB > 1) _tile_zero(7);
  for (int64_t g = 0; g < groups; ++g) {
    _tile_loadd(0, a + g * kGroup, in * 2);
    _tile_loadd(2, b[0] + g * kBf16Group, 64);
    _tile_dpbf16ps(4, 0, 2);
    if constexpr (kB > 1) {
      _tile_loadd(3, b[1] + g * kBf16Group, 64);
      _tile_dpbf16ps(5, 0, 3);
    }
    if constexpr (kA > 1) {
      _tile_loadd(1, a + kAmxRows * in + g * kGroup, in * 2);
      _tile_dpbf16ps(6, 1, 2);
      if constexpr (kB > 1) _tile_dpbf16ps(7, 1, 3);
    }
  }
  _tile_stored(4, y, out * 4);
  if constexpr (kB > 1) _tile_stored(5, y + kTile, out * 4);
  if constexpr (kA > 1) _tile_stored(6, y + kAmxRows * out, out * 4);
  if constexpr (kA > 1 && kB > 1) _tile_stored(7, y + kAmxRows * out + kTile, out * 4);
}

// Tiles [begin, end) against all `rows` (a multiple of 16) bfloat16 input rows `a`, two tiles and 32 rows at a time.
template <typename Codes>
void run_tiles_bf16(const uint8_t* codes, const at::Half* scales, const at::Half* minimums, int64_t groups,
                    const uint16_t* a, int64_t rows, int64_t in, float* y, int64_t padded, int64_t begin, int64_t end) {
  const TileConfig config = TileConfig::bfloat16();
  _tile_loadconfig(&config);
  // Blocks of tiles (kBf16BlockBytes of B operands, at least two tiles), each dequantized once and then run against
  // every 32 input rows in turn: a block stays in cache while the rows pass it, and 32 rows while the block's tiles do.
  const int64_t tile_bytes = groups * kBf16Group * 2;
  const int64_t block = std::max<int64_t>(2, kBf16BlockBytes / tile_bytes / 2 * 2);
  thread_local std::vector<uint16_t> weights;  // kept per thread between calls: its pages are not faulted in again
  if (weights.size() < static_cast<size_t>(block * groups * kBf16Group)) weights.resize(block * groups * kBf16Group);
  for (int64_t t0 = begin; t0 < end; t0 += block) {
    const int64_t n = std::min(block, end - t0);
    for (int64_t j = 0; j < n; ++j)
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t tg = (t0 + j) * groups + g;
        dequantize_group<Codes>(codes + tg * Codes::kTileGroupBytes, scales + tg * kTile,
                                minimums == nullptr ? nullptr : minimums + tg * kTile,
                                weights.data() + (j * groups + g) * kBf16Group);
      }
    for (int64_t r = 0; r < rows; r += 2 * kAmxRows) {
      const uint16_t* ar = a + r * in;
      const bool two_rows = r + kAmxRows < rows;
      for (int64_t j = 0; j < n; j += 2) {
        const uint16_t* b[2] = {weights.data() + j * groups * kBf16Group, weights.data() + (j + 1) * groups * kBf16Group};
        float* yr = y + r * padded + (t0 + j) * kTile;
        if (j + 1 < n && two_rows) bf16_block<2, 2>(ar, in, b, groups, yr, padded);
        else if (j + 1 < n) bf16_block<1, 2>(ar, in, b, groups, yr, padded);
        else if (two_rows) bf16_block<2, 1>(ar, in, b, groups, yr, padded);
        else bf16_block<1, 1>(ar, in, b, groups, yr, padded);
      }
    }
  }
  _tile_release();
}
#endif
#endif

// Vector dot products of every input row with every tile: scales_of(t) gives tile t's HalfScales or CentredScales. Checks what every
// form shares: the rows, the packed codes, out_features.
template <typename Tile, typename ScalesOf>
at::Tensor dot_product(const at::Tensor& rows, const at::Tensor& packed, int64_t out_features, ScalesOf scales_of) {
  TORCH_CHECK(rows.dim() == 2 && (rows.scalar_type() == at::kFloat || rows.scalar_type() == at::kBFloat16) &&
                  rows.is_contiguous(), "rows: contiguous float32 or bfloat16 (m, in)");
  const int64_t m = rows.size(0), in = rows.size(1), groups = in / kGroup, tiles = packed.size(0);
  TORCH_CHECK(in % kGroup == 0 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(1) == groups * Tile::kTileGroupBytes, "packed: contiguous uint8 (tiles, groups · tile bytes)");
  TORCH_CHECK(0 < out_features && out_features <= tiles * kTile && out_features > (tiles - 1) * kTile,
              "out_features must fall in the last tile");
  const int64_t padded = tiles * kTile;
  at::Tensor y = at::empty({m, padded}, rows.options().dtype(at::kFloat));
  const QuantizedRows x(rows, Tile::kCentre);
  const uint8_t* codes = packed.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  for_each_tile(tiles, [&](int64_t t) {
    const uint8_t* p = codes + t * groups * Tile::kTileGroupBytes;
    const auto scales = scales_of(t);
    in_passes<kRowsPerPass>(0, m, [&](auto rows, int64_t r) {
      run_tile<Tile, rows()>(p, scales, groups, x, r, in, yp + r * padded + t * kTile, padded);
    });
  });
  return padded == out_features ? y : y.narrow(1, 0, out_features).contiguous();
}

// The forms a product can take besides vector dot products, as bits: what this build and process can run.
constexpr int64_t kIntegerTiles = 1, kBfloat16Tiles = 2;

inline int64_t tile_forms() {
  int64_t forms = 0;
#ifdef KVSERVE_AMX
  if (amx_permitted()) forms |= kIntegerTiles;
#endif
#ifdef KVSERVE_AMX_BF16
  if (amx_permitted()) forms |= kBfloat16Tiles;
#endif
  return forms;
}

// Codes: kTileGroupBytes (a tile's bytes per group), kCentre (8 or 128), operands(bytes, part, w) (run_tile).
// integer_tiles_from, bfloat16_tiles_from: the input rows from which those forms run, where this build has them
// (measured for the CPU at load: engine/linear/timing.py); below both, vector dot products.
template <typename Tile>
at::Tensor group_product(const at::Tensor& rows, const at::Tensor& packed, const at::Tensor& scale,
                         const at::Tensor& minimum, int64_t out_features, int64_t integer_tiles_from,
                         int64_t bfloat16_tiles_from) {
  TORCH_CHECK(rows.dim() == 2 && (rows.scalar_type() == at::kFloat || rows.scalar_type() == at::kBFloat16) &&
                  rows.is_contiguous(), "rows: contiguous float32 or bfloat16 (m, in)");
  const int64_t m = rows.size(0), in = rows.size(1), groups = in / kGroup, tiles = packed.size(0);
  TORCH_CHECK(in % kGroup == 0 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(1) == groups * Tile::kTileGroupBytes, "packed: contiguous uint8 (tiles, groups · tile bytes)");
  const bool centred = minimum.numel() == 0;  // w = s·(q − centre): no minimums held (CentredScales)
  TORCH_CHECK(scale.scalar_type() == at::kHalf && minimum.scalar_type() == at::kHalf && scale.is_contiguous() &&
                  minimum.is_contiguous() && scale.numel() == tiles * groups * kTile &&
                  (centred || minimum.sizes() == scale.sizes()),
              "scale and minimum: contiguous float16 (tiles, in / 32, 16), minimum empty for centred codes");
  TORCH_CHECK(0 < out_features && out_features <= tiles * kTile && out_features > (tiles - 1) * kTile,
              "out_features must fall in the last tile");
  const int64_t padded = tiles * kTile;
  const uint8_t* codes = packed.data_ptr<uint8_t>();
  const at::Half* scales = scale.data_ptr<at::Half>();
  const at::Half* minimums = centred ? nullptr : minimum.data_ptr<at::Half>();
#ifdef KVSERVE_AMX_BF16
  if (m >= bfloat16_tiles_from && amx_permitted()) {
    const int64_t rows16 = (m + kAmxRows - 1) / kAmxRows * kAmxRows;  // whole tiles of input rows, padded with zeros
    at::Tensor a = rows;
    if (rows16 != m || rows.scalar_type() != at::kBFloat16) {
      a = at::empty({rows16, in}, rows.options().dtype(at::kBFloat16));
      a.narrow(0, 0, m).copy_(rows);
      a.narrow(0, m, rows16 - m).zero_();
    }
    at::Tensor y16 = at::empty({rows16, padded}, rows.options().dtype(at::kFloat));
    const uint16_t* ap = reinterpret_cast<const uint16_t*>(a.data_ptr<at::BFloat16>());
    float* y16p = y16.data_ptr<float>();
    at::parallel_for(0, (tiles + 1) / 2, 1, [&](int64_t begin, int64_t end) {
      run_tiles_bf16<Tile>(codes, scales, minimums, groups, ap, rows16, in, y16p, padded, 2 * begin,
                           std::min(2 * end, tiles));
    });
    return y16.narrow(0, 0, m).narrow(1, 0, out_features).contiguous();
  }
#endif
#ifdef KVSERVE_AMX
  if (m >= integer_tiles_from && amx_permitted()) {
    at::Tensor y = at::empty({m, padded}, rows.options().dtype(at::kFloat));
    const QuantizedRows x(rows, Tile::kCentre);
    float* yp = y.data_ptr<float>();
    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
      run_tiles_amx<Tile>(codes, scales, minimums, groups, x, m, in, yp, padded, begin, end);
    });
    return padded == out_features ? y : y.narrow(1, 0, out_features).contiguous();
  }
#endif
  if (centred)
    return dot_product<Tile>(rows, packed, out_features, [&](int64_t t) { return CentredScales{scales + t * groups * kTile}; });
  return dot_product<Tile>(rows, packed, out_features, [&](int64_t t) {
    return HalfScales{scales + t * groups * kTile, minimums + t * groups * kTile};
  });
}

// The output's shape for torch.compile's tracing: symbolic rows, so a graph traced with a dynamic row count keeps
// it dynamic.
inline at::Tensor group_product_meta(const at::Tensor& rows, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                     int64_t out_features, int64_t, int64_t) {
  return at::empty_symint({rows.sym_size(0), c10::SymInt(out_features)}, rows.options().dtype(at::kFloat));
}

}  // namespace kvserve
