// rows (m, in) float32 or bfloat16 · W(out, in)ᵀ -> (m, out) float32, W held as GGUF's Q6_K super-blocks, as stored:
// per 256 inputs of a row a float16 d, per 16 inputs an int8 scale sc, per input a 6-bit code q; w = d·sc·(q − 32).
//
// The products are llama.cpp's for Q6_K (super_block.h): per super-block and output row,
//   Σ w·x ≈ d·e·Σ_h sc_h·(Σ q·x̂ − 32·Σ x̂)  over its 16 sub-blocks h,   x ≈ e·x̂ (8-bit inputs, one scale e per 256),
// in integers until the end of the super-block: a half-group's Σ q·x̂ as two int16 sums of vpmaddubsw pairs (q <= 63,
// |x̂| <= 127: two pairs' sum fits in int16) times sc by vpmaddwd, and 32·sc·Σ x̂ two halves per vpmaddwd (with
// AVX-512, vpdpbusd's sums centred first, then times sc in 32 bits). Bounds: |Σ sc·q·x̂| <= 256·128·63·127 over a
// super-block, inside int32.
//
// Layout (made by engine/linear/quantized.py): tiles of 16 output rows; per tile and group, 384 bytes: the codes'
// low 4 bits as codes4_product.cpp packs 4-bit codes (256 bytes, four runs of 64), then their high 2 bits in two
// planes of 64: byte b of plane j holds, in its low nibble, the high bits of run 2j's byte b (bits 0-1: its low
// nibble's input, 2-3: its high nibble's) and in its high nibble those of run 2j + 1's byte b. A plane's field then
// reaches bits 4-5 of its code by one shift and one mask, each byte's on its own (AVX2 reads a part's half of the
// runs and of the planes alike). scale: int8 (tiles, groups, 2, 16), each half's sc per row; d: float16
// (tiles, groups / 8, 16).
#include <torch/library.h>

#include "super_block.h"

namespace kvserve {
namespace {

struct Codes6Tile {
  static constexpr int64_t kTileGroupBytes = kTile * kGroup / 2 + kTile * kGroup / 4;
  static constexpr int32_t kCentre = 32;

  // As Codes4Tile's operands, each byte completed by its two high bits: w[2k] inputs 8k..8k+3, w[2k+1] 8k+4..8k+7.
  // High-bit byte b of plane j holds those of runs 2j and 2j + 1 at their byte b, in 2-bit fields from bit 0: run
  // 2j's low-nibble code, its high-nibble code, then run 2j + 1's two. Each field is moved to bits 4-5 (a 16-bit
  // shift whose spill across bytes the mask clears) and joined to its nibble.
  static void operands(const uint8_t* bytes, int part, Operand (&w)[8]) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    const Operand nibble = _mm512_set1_epi8(0x0F), field = _mm512_set1_epi8(0x30);
    constexpr int kNibbleOrHigh = 0xEC;  // vpternlogd: (a & c) | b, a the codes, b the high bits, c the nibble mask
    for (int j = 0; j < 2; ++j) {
      const Operand high = _mm512_loadu_si512(bytes + 256 + 64 * j);
      const Operand first = _mm512_loadu_si512(bytes + 128 * j), second = _mm512_loadu_si512(bytes + 128 * j + 64);
      w[4 * j] = _mm512_ternarylogic_epi32(first, _mm512_and_si512(_mm512_slli_epi16(high, 4), field), nibble, kNibbleOrHigh);
      w[4 * j + 1] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(first, 4),
                                               _mm512_and_si512(_mm512_slli_epi16(high, 2), field), nibble, kNibbleOrHigh);
      w[4 * j + 2] = _mm512_ternarylogic_epi32(second, _mm512_and_si512(high, field), nibble, kNibbleOrHigh);
      w[4 * j + 3] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(second, 4),
                                               _mm512_and_si512(_mm512_srli_epi16(high, 2), field), nibble, kNibbleOrHigh);
    }
#else
    const Operand nibble = _mm256_set1_epi8(0x0F), field = _mm256_set1_epi8(0x30);
    const auto join = [&](Operand codes, Operand high) {
      return _mm256_or_si256(_mm256_and_si256(codes, nibble), _mm256_and_si256(high, field));
    };
    for (int j = 0; j < 2; ++j) {
      const auto at = [&](int64_t offset) {
        return _mm256_loadu_si256(reinterpret_cast<const Operand*>(bytes + offset + 32 * part));
      };
      const Operand high = at(256 + 64 * j), first = at(128 * j), second = at(128 * j + 64);
      w[4 * j] = join(first, _mm256_slli_epi16(high, 4));
      w[4 * j + 1] = join(_mm256_srli_epi16(first, 4), _mm256_slli_epi16(high, 2));
      w[4 * j + 2] = join(second, high);
      w[4 * j + 3] = join(_mm256_srli_epi16(second, 4), _mm256_srli_epi16(high, 2));
    }
#endif
  }
};

// superblock_tile's Format: sums[r][0] = Σ_h sc_h·Σ q·x̂ over a super-block's halves h of groups, sums[r][1] =
// Σ_h sc_h·Σ x̂ (AVX2: the centre comes off once per super-block; with AVX-512 it comes off each half's vpdpbusd
// sums before the 32-bit multiply, and sums[r][1] stays 0).
struct SubBlock6Format {
  using Codes = Codes6Tile;
  static constexpr int kSums = 2;
  static constexpr int32_t kCentreShift = 5;  // 32 = Codes6Tile::kCentre
  static_assert(Codes6Tile::kCentre == 1 << kCentreShift);
  const uint8_t* packed;
  const int8_t* sc;
  const at::Half* d;
  int64_t groups;

  template <int R>
  void add(int64_t t, int64_t g, int part, const Operand (&w)[8], const QuantizedSuperBlocks& x, int64_t row,
           Sums (&sums)[R][kSums]) const {
    const int8_t* scg = sc + (t * groups + g) * 2 * kTile;  // (low half's sc, high half's) per row
    const int64_t in = groups * kGroup;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    const __m512i s0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scg)));
    const __m512i s1 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scg + kTile)));
    for (int r = 0; r < R; ++r) {
      const int8_t* xq = x.codes.data() + (row + r) * in + g * kGroup;
      const int16_t* halves = x.half_sum.data() + ((row + r) * groups + g) * 2;
      __m512i low = _mm512_set1_epi32(-Codes6Tile::kCentre * halves[0]);
      __m512i high = _mm512_set1_epi32(-Codes6Tile::kCentre * halves[1]);
      for (int k = 0; k < 4; ++k) {  // w[0..3]: inputs 0..15, w[4..7]: 16..31
        low = _mm512_dpbusd_epi32(low, w[k], _mm512_set1_epi32(four_codes(xq + 4 * k)));
        high = _mm512_dpbusd_epi32(high, w[k + 4], _mm512_set1_epi32(four_codes(xq + 16 + 4 * k)));
      }
      sums[r][0] = _mm512_add_epi32(sums[r][0], _mm512_add_epi32(_mm512_mullo_epi32(low, s0), _mm512_mullo_epi32(high, s1)));
    }
#else
    const __m128i s0 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(scg + kPartRows * part));
    const __m128i s1 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(scg + kTile + kPartRows * part));
    const __m256i low_scale = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(s0, s0));  // sc twice per row, as int16
    const __m256i high_scale = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(s1, s1));
    const __m256i both_scales = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(s0, s1));  // (sc_low, sc_high) per row
    for (int r = 0; r < R; ++r) {
      const int8_t* xq = x.codes.data() + (row + r) * in + g * kGroup;
      const auto pairs = [&](int k) {  // int16: Σ of inputs 4k..4k+7's q·x̂ per row
        return _mm256_add_epi16(_mm256_maddubs_epi16(w[k], _mm256_set1_epi32(four_codes(xq + 4 * k))),
                                _mm256_maddubs_epi16(w[k + 1], _mm256_set1_epi32(four_codes(xq + 4 * k + 4))));
      };
      const __m256i low = _mm256_add_epi32(_mm256_madd_epi16(pairs(0), low_scale), _mm256_madd_epi16(pairs(2), low_scale));
      const __m256i high = _mm256_add_epi32(_mm256_madd_epi16(pairs(4), high_scale), _mm256_madd_epi16(pairs(6), high_scale));
      sums[r][0] = _mm256_add_epi32(sums[r][0], _mm256_add_epi32(low, high));
      const int32_t halves = QuantizedSuperBlocks::pair(x.half_sum.data() + ((row + r) * groups + g) * 2);
      sums[r][1] = _mm256_add_epi32(sums[r][1], _mm256_madd_epi16(both_scales, _mm256_set1_epi32(halves)));
    }
#endif
  }

  // acc += d·e·(sums[0] − 32·sums[1])
  template <int R>
  void fold(int64_t t, int64_t b, int part, const QuantizedSuperBlocks& x, int64_t row, Sums (&sums)[R][kSums],
            Floats (&acc)[R]) const {
    const int64_t blocks = groups / kSuperBlockGroups, lanes = (t * blocks + b) * kTile + kPartRows * part;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + lanes)));
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r][0]), _mm512_mul_ps(dv, _mm512_set1_ps(x.scale[(row + r) * blocks + b])),
                               acc[r]);
#else
    const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + lanes)));
    for (int r = 0; r < R; ++r) {
      const __m256i total = _mm256_sub_epi32(sums[r][0], _mm256_slli_epi32(sums[r][1], kCentreShift));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(dv, _mm256_set1_ps(x.scale[(row + r) * blocks + b])),
                               acc[r]);
    }
#endif
  }

#ifdef KVSERVE_AMX
  // superblock_tile_amx's: per half group (its own sc) of super-block b one tdpbsud gives the 16 rows' Σ q·x̂ over 16
  // inputs (the integers `add` takes by vpdpbusd), centred, times sc and summed in int32 as `add` does; sums[r][1]
  // stays 0, as in `add`.
  static TileConfig tile_config() { return TileConfig::halves(); }

  void tile_sums(int64_t t, int64_t b, const QuantizedSuperBlocks& x, int64_t row, Sums (&sums)[kAmxRows][kSums]) const {
    constexpr int64_t kHalf = kGroup / 2;
    const int64_t in = groups * kGroup;
    const uint8_t* codes = packed + t * groups * Codes6Tile::kTileGroupBytes;
    const int8_t* inputs = x.codes.data() + row * in;
    alignas(64) uint8_t weights[2][8 * 64];  // two groups' operands: per group, 4 of the low half, 4 of the high
    alignas(64) int32_t dots[4][kAmxRows * kTile];  // per group, its low half's and its high half's
    for (int64_t g0 = b * kSuperBlockGroups; g0 < (b + 1) * kSuperBlockGroups; g0 += 2) {
      for (int i = 0; i < 2; ++i) {
        Operand w[8];
        Codes6Tile::operands(codes + (g0 + i) * Codes6Tile::kTileGroupBytes, 0, w);
        for (int k = 0; k < 8; ++k) _mm512_store_si512(weights[i] + 64 * k, w[k]);
      }
#define KVSERVE_AMX_HALF(i, h, a, bt, c)                                   \
  _tile_zero(c);                                                          \
  _tile_loadd(a, inputs + (g0 + i) * kGroup + h * kHalf, in);             \
  _tile_loadd(bt, weights[i] + h * 256, 64);                              \
  _tile_dpbsud(c, a, bt);
      KVSERVE_AMX_HALF(0, 0, 0, 2, 4)
      KVSERVE_AMX_HALF(0, 1, 1, 3, 5)
      KVSERVE_AMX_HALF(1, 0, 0, 2, 6)
      KVSERVE_AMX_HALF(1, 1, 1, 3, 7)
#undef KVSERVE_AMX_HALF
      _tile_stored(4, dots[0], kTile * 4);
      _tile_stored(5, dots[1], kTile * 4);
      _tile_stored(6, dots[2], kTile * 4);
      _tile_stored(7, dots[3], kTile * 4);
      for (int i = 0; i < 2; ++i) {
        const int8_t* scg = sc + (t * groups + g0 + i) * 2 * kTile;
        const __m512i s0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scg)));
        const __m512i s1 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scg + kTile)));
        for (int r = 0; r < kAmxRows; ++r) {
          const int16_t* halves = x.half_sum.data() + ((row + r) * groups + g0 + i) * 2;
          const __m512i low = _mm512_sub_epi32(_mm512_load_si512(dots[2 * i] + r * kTile),
                                               _mm512_set1_epi32(Codes6Tile::kCentre * halves[0]));
          const __m512i high = _mm512_sub_epi32(_mm512_load_si512(dots[2 * i + 1] + r * kTile),
                                                _mm512_set1_epi32(Codes6Tile::kCentre * halves[1]));
          sums[r][0] = _mm512_add_epi32(sums[r][0], _mm512_add_epi32(_mm512_mullo_epi32(low, s0), _mm512_mullo_epi32(high, s1)));
        }
      }
    }
  }
#endif
};

at::Tensor subblock6_product(const at::Tensor& rows, const at::Tensor& packed, const at::Tensor& scale,
                             const at::Tensor& d, int64_t out_features, int64_t integer_tiles_from) {
  const int64_t groups = rows.size(1) / kGroup, tiles = packed.size(0);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(1) == groups * Codes6Tile::kTileGroupBytes, "packed: contiguous uint8 (tiles, groups · 384)");
  TORCH_CHECK(scale.scalar_type() == at::kChar && scale.is_contiguous() && scale.numel() == tiles * groups * 2 * kTile,
              "scale: contiguous int8 (tiles, in / 32, 2, 16)");
  TORCH_CHECK(d.scalar_type() == at::kHalf && d.is_contiguous() && d.numel() == tiles * (groups / kSuperBlockGroups) * kTile,
              "d: contiguous float16 (tiles, in / 256, 16)");
  const SubBlock6Format format{packed.data_ptr<uint8_t>(), scale.data_ptr<int8_t>(), d.data_ptr<at::Half>(), groups};
  return superblock_products(rows, tiles, out_features, format, integer_tiles_from);
}

at::Tensor subblock6_product_meta(const at::Tensor& rows, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                  int64_t out_features, int64_t) {
  return superblock_products_meta(rows, out_features);
}

}  // namespace
}  // namespace kvserve

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("subblock6_product(Tensor rows, Tensor packed, Tensor scale, Tensor d, int out_features, int integer_tiles_from) -> Tensor");
}
TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("subblock6_product", &kvserve::subblock6_product); }
TORCH_LIBRARY_IMPL(kvserve, Meta, m) { m.impl("subblock6_product", &kvserve::subblock6_product_meta); }
