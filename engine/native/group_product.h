// What the 4-bit and 8-bit group-code products share: the inputs quantized to 8 bits per group of 32, and the
// loop that runs a tile kernel over every 16-row tile of the weight (split over torch's threads) and every
// input row (in passes of kRowsPerPass rows that share one load of the tile's codes).
//
// A product's result: Σ_i w_i·x_i with w_i = s·q_i + m per group, computed as
//   s·d·Σ (q_i - c)·x̂_i + (m + c·s)·Σ x_i,   x_i ≈ d·x̂_i,  c the codes' centre (8 or 128),
// so that the rounding error of x̂ meets centred codes, and the rest of each weight meets the exact sum of x.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if !defined(__AVX2__) || !defined(__F16C__) || !defined(__FMA__)
#error "kvserve's group-code products need AVX2, FMA and F16C"
#endif

namespace kvserve {

constexpr int64_t kGroup = 32;
constexpr int64_t kTile = 16;  // output rows per tile
constexpr int kRowsPerPass = 4;

// The input rows, group by group: 8-bit codes x̂, their scale d, the exact sum Σ x, and c·Σ x̂.
struct QuantizedRows {
  std::vector<int8_t> codes;  // (m, in)
  std::vector<float> scale, sum;  // (m, groups)
  std::vector<int32_t> centred_sum;  // (m, groups)

  QuantizedRows(const float* x, int64_t m, int64_t in, int32_t centre)
      : codes(m * in), scale(m * in / kGroup), sum(m * in / kGroup), centred_sum(m * in / kGroup) {
    for (int64_t i = 0; i < m * in / kGroup; ++i) {
      const float* v = x + i * kGroup;
      float largest = 0, total = 0;
      for (int64_t j = 0; j < kGroup; ++j) largest = std::max(largest, std::fabs(v[j])), total += v[j];
      const float inverse = largest > 0 ? 127.f / largest : 0.f;
      int32_t code_total = 0;
      for (int64_t j = 0; j < kGroup; ++j) {
        const int8_t q = static_cast<int8_t>(std::nearbyint(v[j] * inverse));
        codes[i * kGroup + j] = q;
        code_total += q;
      }
      scale[i] = largest / 127.f, sum[i] = total, centred_sum[i] = centre * code_total;
    }
  }
};

inline int32_t four_codes(const int8_t* p) {  // 4 input codes as one broadcastable dword
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Tile::run<R>(packed, scale, minimum, groups, x, row, in, y, out): R input rows from `row` · one tile -> y.
template <typename Tile>
at::Tensor group_product(const at::Tensor& rows, const at::Tensor& packed, const at::Tensor& scale,
                         const at::Tensor& minimum, int64_t out_features) {
  TORCH_CHECK(rows.dim() == 2 && rows.scalar_type() == at::kFloat && rows.is_contiguous(), "rows: contiguous float32 (m, in)");
  const int64_t m = rows.size(0), in = rows.size(1), groups = in / kGroup, tiles = packed.size(0);
  TORCH_CHECK(in % kGroup == 0 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(1) == groups * Tile::kTileGroupBytes, "packed: contiguous uint8 (tiles, groups · tile bytes)");
  TORCH_CHECK(scale.scalar_type() == at::kHalf && minimum.scalar_type() == at::kHalf && scale.is_contiguous() &&
                  minimum.is_contiguous() && scale.numel() == tiles * groups * kTile && minimum.sizes() == scale.sizes(),
              "scale and minimum: contiguous float16 (tiles, in / 32, 16)");
  TORCH_CHECK(0 < out_features && out_features <= tiles * kTile && out_features > (tiles - 1) * kTile,
              "out_features must fall in the last tile");
  const int64_t padded = tiles * kTile;
  at::Tensor y = at::empty({m, padded}, rows.options());
  const QuantizedRows x(rows.data_ptr<float>(), m, in, Tile::kCentre);
  const uint8_t* codes = packed.data_ptr<uint8_t>();
  const at::Half* scales = scale.data_ptr<at::Half>();
  const at::Half* minimums = minimum.data_ptr<at::Half>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* p = codes + t * groups * Tile::kTileGroupBytes;
      const at::Half* s = scales + t * groups * kTile;
      const at::Half* mn = minimums + t * groups * kTile;
      int64_t r = 0;
      for (; r + kRowsPerPass <= m; r += kRowsPerPass)
        Tile::template run<kRowsPerPass>(p, s, mn, groups, x, r, in, yp + r * padded + t * kTile, padded);
      for (; r < m; ++r) Tile::template run<1>(p, s, mn, groups, x, r, in, yp + r * padded + t * kTile, padded);
    }
  });
  return padded == out_features ? y : y.narrow(1, 0, out_features).contiguous();
}

// The output's shape for torch.compile's tracing: symbolic rows, so a graph traced with a dynamic row count keeps
// it dynamic.
inline at::Tensor group_product_meta(const at::Tensor& rows, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                     int64_t out_features) {
  return at::empty_symint({rows.sym_size(0), c10::SymInt(out_features)}, rows.options());
}

}  // namespace kvserve
