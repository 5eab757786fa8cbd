// The vector operations kvserve's float32 kernels are written in, for one width: 8 float32 lanes (AVX2) or 16
// (AVX-512), and an exponential in them. A kernel written once over `L` runs at the widest the CPU has; its
// result may differ in the last bits between the widths, never between rows or batches at one width.
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include <cstdint>

#include "eight.h"

namespace kvserve {

struct Lanes8 {
  using V = __m256;
  static constexpr int64_t width = 8;
  static constexpr int sums = 8;  // weighted-value sums kept in registers at a time: 16 registers in all
  static V zero() { return _mm256_setzero_ps(); }
  static V set(float x) { return _mm256_set1_ps(x); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load(const at::BFloat16* p) { return load8(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V broadcast(const float* p) { return _mm256_broadcast_ss(p); }
  static float largest(V a) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
  }
  static float total(V a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
  }
  // Lane i: the sum of a[i]'s lanes, in a fixed order.
  static V lane_sums(const V (&a)[width]) {
    const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));  // per 128-bit half
    const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
  }
  static V round(V x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static V two_to(V n) {  // 2^n for integral n in float32's normal range
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V fnmadd(V a, V b, V c) { return _mm256_fnmadd_ps(a, b, c); }
  static bool any_equal(V a, V b) { return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_EQ_OQ)) != 0; }
  // Sums in float64: a vector's lower lanes added into wide[0], its upper ones into wide[1].
  using D = __m256d;
  static D wide_zero() { return _mm256_setzero_pd(); }
  static void add_wide(D (&wide)[2], V a) {
    wide[0] = _mm256_add_pd(wide[0], _mm256_cvtps_pd(_mm256_castps256_ps128(a)));
    wide[1] = _mm256_add_pd(wide[1], _mm256_cvtps_pd(_mm256_extractf128_ps(a, 1)));
  }
  static double wide_total(D a) {
    const __m128d two = _mm_add_pd(_mm256_castpd256_pd128(a), _mm256_extractf128_pd(a, 1));
    return _mm_cvtsd_f64(_mm_add_sd(two, _mm_unpackhi_pd(two, two)));
  }
  static D wide_add(D a, D b) { return _mm256_add_pd(a, b); }
};

#if defined(__AVX512F__)
struct Lanes16 {
  using V = __m512;
  static constexpr int64_t width = 16;
  static constexpr int sums = 16;  // of 32 registers
  static V zero() { return _mm512_setzero_ps(); }
  static V set(float x) { return _mm512_set1_ps(x); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const at::BFloat16* p) {  // bfloat16 is float32's upper half
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
  }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V broadcast(const float* p) { return _mm512_set1_ps(*p); }
  static float largest(V a) { return _mm512_reduce_max_ps(a); }
  static float total(V a) { return _mm512_reduce_add_ps(a); }
  // Lane i: the sum of a[i]'s lanes, in a fixed order. Each level halves the vectors and the lanes per sum:
  // 16 vectors of 16 partial sums, 8 of 2·8, 4 of 4·4, 2 of 8·2, 1 of 16.
  static V lane_sums(const V (&a)[width]) {
    V b[8], c[4];
    for (int i = 0; i < 8; ++i)  // 128-bit lanes: a[i]'s halves in 0-1, a[i + 8]'s in 2-3
      b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[i], a[i + 8], 0x44), _mm512_shuffle_f32x4(a[i], a[i + 8], 0xEE));
    for (int i = 0; i < 4; ++i)  // 128-bit lanes: the sums of a[i], a[i + 8], a[i + 4], a[i + 12], 4 each
      c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[i], b[i + 4], 0x88), _mm512_shuffle_f32x4(b[i], b[i + 4], 0xDD));
    const V d0 = _mm512_add_ps(_mm512_unpacklo_ps(c[0], c[1]), _mm512_unpackhi_ps(c[0], c[1]));  // 2 each
    const V d1 = _mm512_add_ps(_mm512_unpacklo_ps(c[2], c[3]), _mm512_unpackhi_ps(c[2], c[3]));
    const V e = _mm512_add_ps(_mm512_shuffle_ps(d0, d1, 0x44), _mm512_shuffle_ps(d0, d1, 0xEE));  // lanes 0-3, 8-11, 4-7, 12-15
    return _mm512_shuffle_f32x4(e, e, 0xD8);
  }
  static V round(V x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static V two_to(V n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
  }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V fnmadd(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }
  static bool any_equal(V a, V b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ) != 0; }
  using D = __m512d;
  static D wide_zero() { return _mm512_setzero_pd(); }
  static void add_wide(D (&wide)[2], V a) {
    const __m256 upper = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
    wide[0] = _mm512_add_pd(wide[0], _mm512_cvtps_pd(_mm512_castps512_ps256(a)));
    wide[1] = _mm512_add_pd(wide[1], _mm512_cvtps_pd(upper));
  }
  static double wide_total(D a) { return _mm512_reduce_add_pd(a); }
  static D wide_add(D a, D b) { return _mm512_add_pd(a, b); }
};
#endif

// The widest lanes this build has.
#if defined(__AVX512F__)
using Widest = Lanes16;
#else
using Widest = Lanes8;
#endif

// exp(x) for x <= 0, a vector at a time: x = n·ln 2 + r, |r| <= ln 2 / 2, exp(r) by its Taylor series to r⁶
// (relative error under 2e-7), times 2^n. Below -87 (float32's smallest normal number is e^-87.3) it gives e^-87:
// a weight no sum can tell from 0 (every sum holds its maximum's weight, 1).
template <class L>
typename L::V exp_nonpositive(typename L::V x) {
  x = L::max(x, L::set(-87.f));
  const auto n = L::round(L::mul(x, L::set(1.44269504f)));
  const auto r = L::fnmadd(n, L::set(1.42860677e-6f), L::fnmadd(n, L::set(0.693145752f), x));
  auto p = L::set(1.f / 720);  // ln 2 in two parts above: n·ln 2 exact to float
  for (const float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = L::fmadd(p, r, L::set(c));
  return L::mul(p, L::two_to(n));
}

}  // namespace kvserve
