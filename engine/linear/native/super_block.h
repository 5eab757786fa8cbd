// What the K-quants' products share (superblock_product.cpp: Q4_K and Q5_K; subblock6_product.cpp: Q6_K): the input
// rows quantized to 8 bits per super-block of 256, as llama.cpp's Q8_K quantizes them, and the loop over tiles,
// super-blocks, their groups and input rows (superblock_tile), into which each type adds its integer sums.
//
// One input scale per super-block keeps each super-block's sums in integers: the weights' sub-block scales multiply
// the integer dot products (vpmaddwd, or a 32-bit multiply with AVX-512), the minimums meet the integer Σ x̂ of their
// groups, and floats appear once per super-block and output row (d and dmin times the input's scale). The error is
// then that of llama.cpp's K-quant products on the same file: Σ w·(x̂·scale − x) over 8-bit inputs.
#pragma once

#include <limits>

#include "group_product.h"

namespace kvserve {

constexpr int64_t kSuperBlockGroups = 8;
constexpr int64_t kSuperBlock = kSuperBlockGroups * kGroup;
// The input rows, super-block by super-block: 8-bit codes x̂, one scale per 256 inputs, and Σ x̂ of every 32 and
// of every 16 inputs (at most 32·127 in magnitude: int16).
struct QuantizedSuperBlocks {
  std::vector<int8_t> codes;  // (m, in)
  std::vector<float> scale;  // (m, in / 256)
  std::vector<int16_t> group_sum;  // (m, in / 32)
  std::vector<int16_t> half_sum;  // (m, in / 16)

  // rows: (m, in) float32 or bfloat16, contiguous, in a multiple of 256.
  explicit QuantizedSuperBlocks(const at::Tensor& rows)
      : codes(rows.numel()), scale(rows.numel() / kSuperBlock), group_sum(rows.numel() / kGroup),
        half_sum(rows.numel() / (kGroup / 2)) {
    if (rows.scalar_type() == at::kBFloat16) quantize(rows.data_ptr<at::BFloat16>());
    else quantize(rows.data_ptr<float>());
  }

  // Vectorized, yet the bits of the scalar loop's: the same largest |x|, the same float product x·(127 / largest)
  // per input, rounded to nearest even (MXCSR's mode, as nearbyint), and exact integer sums.
  template <typename T>
  void quantize(const T* x) {
    for (size_t b = 0; b < scale.size(); ++b) {
      const T* v = x + b * kSuperBlock;
      using namespace sixteen;
      Sixteen largest = zero();
      for (int64_t j = 0; j < kSuperBlock; j += 16) largest = max_abs(largest, load(v + j));
      const float most = largest_of(largest);
      const float inverse = most > 0 ? 127.f / most : 0.f;
      for (int64_t h = 0; h < 2 * kSuperBlockGroups; ++h) {  // halves of groups: 16 inputs
        half_sum[2 * kSuperBlockGroups * b + h] =
            static_cast<int16_t>(round_codes(load(v + 16 * h), inverse, codes.data() + b * kSuperBlock + 16 * h));
      }
      for (int64_t g = 0; g < kSuperBlockGroups; ++g) {
        const int64_t first = 2 * kSuperBlockGroups * b + 2 * g;
        group_sum[kSuperBlockGroups * b + g] = static_cast<int16_t>(half_sum[first] + half_sum[first + 1]);
      }
      scale[b] = most / 127.f;
    }
  }


  // Two neighbouring int16 sums as one broadcastable dword: the low half the first.
  static int32_t pair(const int16_t* sums) {
    int32_t v;
    std::memcpy(&v, sums, 4);
    return v;
  }
};

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
using Sums = __m512i;  // int32 per output row of a part
using Floats = __m512;
inline Sums zero_sums() { return _mm512_setzero_si512(); }
inline Floats zero_floats() { return _mm512_setzero_ps(); }
inline void store(float* y, Floats v) { _mm512_storeu_ps(y, v); }
#else
using Sums = __m256i;
using Floats = __m256;
inline Sums zero_sums() { return _mm256_setzero_si256(); }
inline Floats zero_floats() { return _mm256_setzero_ps(); }
inline void store(float* y, Floats v) { _mm256_storeu_ps(y, v); }
#endif
constexpr int64_t kPartRows = kTile / kParts;  // output rows per part of a tile
// Input rows per pass over a tile, at most: each row holds two integer sums and a float sum per part in registers,
// beside the tile's 8 operands and its scales. AVX-512's 32 registers take 5 rows (a verifying step's 1 + 4 drafts
// in one pass: 1.15x the Q4_K product of 2 passes, 4 and 1), AVX2's 16 take 4.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int kSuperBlockRowsPerPass = 5;
#else
constexpr int kSuperBlockRowsPerPass = 4;
#endif

// Tile t's 16 outputs of input rows row..row+R-1 into y (row stride `out`), super-block by super-block and, within
// one, part by part (both AVX2 parts while the super-block's lines are in cache). What differs between the K-quants
// is the Format's:
// - Codes: the code layout (kTileGroupBytes, operands);
// - add<R>(t, g, part, w, x, row, sums): group g's integer sums of every row into sums[r][0..kSums-1];
// - fold<R>(t, b, part, x, row, sums, acc): super-block b's sums into the float results acc[r].
template <typename Format, int R>
void superblock_tile(const Format& format, int64_t t, const QuantizedSuperBlocks& x, int64_t row, float* y,
                     int64_t out) {
  using Codes = typename Format::Codes;
  const int64_t blocks = format.groups / kSuperBlockGroups;
  const uint8_t* codes = format.packed + t * format.groups * Codes::kTileGroupBytes;
  Floats acc[kParts][R];
  for (int part = 0; part < kParts; ++part)
    for (int r = 0; r < R; ++r) acc[part][r] = zero_floats();
  for (int64_t b = 0; b < blocks; ++b) {
    for (int part = 0; part < kParts; ++part) {
      Sums sums[R][Format::kSums];
      for (int r = 0; r < R; ++r)
        for (int k = 0; k < Format::kSums; ++k) sums[r][k] = zero_sums();
      for (int64_t g = b * kSuperBlockGroups; g < (b + 1) * kSuperBlockGroups; ++g) {
        const uint8_t* group = codes + g * Codes::kTileGroupBytes;
        if (part == 0) prefetch(group + kPrefetchBytes, Codes::kTileGroupBytes);
        Operand w[8];
        Codes::operands(group, part, w);
        format.template add<R>(t, g, part, w, x, row, sums);
      }
      format.template fold<R>(t, b, part, x, row, sums, acc[part]);
    }
  }
  for (int part = 0; part < kParts; ++part)
    for (int r = 0; r < R; ++r) store(y + r * out + kPartRows * part, acc[part][r]);
}

#ifdef KVSERVE_AMX
// superblock_tile for the 16 input rows from `row` by AMX's integer tiles (configured by Format::tile_config()): per
// super-block, the Format's tile_sums<R>(t, b, x, row, sums) gives every row's integer sums as `add` sums them (the
// tile products are the integers the dot products sum, exact in any order), then `fold` as the vector path folds, so
// a row's products are the same bits by either path, at any row count.
template <typename Format>
void superblock_tile_amx(const Format& format, int64_t t, const QuantizedSuperBlocks& x, int64_t row, float* y,
                         int64_t out) {
  Floats acc[kAmxRows];
  for (int r = 0; r < kAmxRows; ++r) acc[r] = zero_floats();
  for (int64_t b = 0; b < format.groups / kSuperBlockGroups; ++b) {
    Sums sums[kAmxRows][Format::kSums];
    for (int r = 0; r < kAmxRows; ++r)
      for (int k = 0; k < Format::kSums; ++k) sums[r][k] = zero_sums();
    format.tile_sums(t, b, x, row, sums);
    format.template fold<kAmxRows>(t, b, 0, x, row, sums, acc);
  }
  for (int r = 0; r < kAmxRows; ++r) store(y + r * out, acc[r]);
}
#endif

// Every input row times every tile of a K-quant weight (Format: superblock_tile's), tiles split over torch's
// threads (for_each_tile), input rows in passes of up to kSuperBlockRowsPerPass (in_passes: a pass per row would
// read the tile's codes again for each). From `integer_tiles_from` rows, where this build and process have AMX, each
// whole 16 rows go through superblock_tile_amx instead: the same integer sums, so a row gets the same bits either
// way. Checks what every K-quant product shares.
template <typename Format>
at::Tensor superblock_products(const at::Tensor& rows, int64_t tiles, int64_t out_features, const Format& format,
                               int64_t integer_tiles_from = std::numeric_limits<int64_t>::max()) {
  TORCH_CHECK(rows.dim() == 2 && (rows.scalar_type() == at::kFloat || rows.scalar_type() == at::kBFloat16) &&
                  rows.is_contiguous(), "rows: contiguous float32 or bfloat16 (m, in)");
  TORCH_CHECK(rows.size(1) % kSuperBlock == 0, "K-quants' inputs come in super-blocks of 256");
  TORCH_CHECK(0 < out_features && out_features <= tiles * kTile && out_features > (tiles - 1) * kTile,
              "out_features must fall in the last tile");
  const int64_t m = rows.size(0), padded = tiles * kTile;
  at::Tensor y = at::empty({m, padded}, rows.options().dtype(at::kFloat));
  const QuantizedSuperBlocks x(rows);
  float* yp = y.data_ptr<float>();
  int64_t tiled_rows = 0;  // the leading rows that go through integer tiles, 16 at a time
#ifdef KVSERVE_AMX
  if (m >= integer_tiles_from && amx_permitted()) tiled_rows = m / kAmxRows * kAmxRows;
#endif
  const auto vector_rows = [&](int64_t t) {  // the rows after the integer tiles' (all of them, without AMX)
    in_passes<kSuperBlockRowsPerPass>(tiled_rows, m, [&](auto rows, int64_t r) {
      superblock_tile<Format, rows()>(format, t, x, r, yp + r * padded + t * kTile, padded);
    });
  };
#ifdef KVSERVE_AMX
  if (tiled_rows > 0) {  // many rows, compute-bound: torch's even split
    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
      const TileConfig config = Format::tile_config();
      _tile_loadconfig(&config);  // per thread, as torch's threads run these tiles
      for (int64_t t = begin; t < end; ++t)
        for (int64_t r = 0; r < tiled_rows; r += kAmxRows)
          superblock_tile_amx(format, t, x, r, yp + r * padded + t * kTile, padded);
      _tile_release();
      for (int64_t t = begin; t < end; ++t) vector_rows(t);
    });
    return padded == out_features ? y : y.narrow(1, 0, out_features).contiguous();
  }
#endif
  for_each_tile(tiles, vector_rows);
  return padded == out_features ? y : y.narrow(1, 0, out_features).contiguous();
}

inline at::Tensor superblock_products_meta(const at::Tensor& rows, int64_t out_features) {
  return at::empty_symint({rows.sym_size(0), c10::SymInt(out_features)}, rows.options().dtype(at::kFloat));
}

}  // namespace kvserve
