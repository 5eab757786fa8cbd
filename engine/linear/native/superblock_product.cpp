// rows (m, in) float32 or bfloat16 · W(out, in)ᵀ -> (m, out) float32, W held as GGUF's Q4_K or Q5_K super-blocks, as
// stored: per 256 inputs of a row, float16 d and dmin; per group of 32 inputs, 6-bit sc and mn; per input a 4-bit
// (Q4_K) or 5-bit (Q5_K) code q; w = d·sc·q − dmin·mn. Each group is then a 4-bit group of Q4_1's form, scale d·sc and minimum −dmin·mn, and runs
// through the same integer dot products (group_product.h, `SuperBlockScales`): the inputs quantized to 8 bits per
// group, the codes centred on 8.
//
// Layout (made by engine/linear/quantized.py): the codes packed as codes4_product.cpp and codes5_product.cpp pack them
// (tiles of 16 output rows, 256 or 320 bytes per tile and group); group_scale and group_minimum: uint8 (tiles, groups, 16); scale and
// minimum_scale: float16 (tiles, groups / 8, 16). 4.625 bits per weight against the file's 4.5: sc and mn take a
// byte each rather than 6 bits, so that a group's are one load.
#include <torch/library.h>

#include "group_product.h"

namespace kvserve {
namespace {

template <typename Tile>
at::Tensor superblock_product(const at::Tensor& rows, const at::Tensor& packed, const at::Tensor& group_scale,
                               const at::Tensor& group_minimum, const at::Tensor& scale,
                               const at::Tensor& minimum_scale, int64_t out_features) {
  const int64_t groups = rows.size(1) / kGroup, tiles = packed.size(0);
  TORCH_CHECK(groups % kSuperBlockGroups == 0, "K-quants' inputs come in super-blocks of 256");
  TORCH_CHECK(group_scale.scalar_type() == at::kByte && group_minimum.scalar_type() == at::kByte &&
                  group_scale.is_contiguous() && group_minimum.is_contiguous() &&
                  group_scale.numel() == tiles * groups * kTile && group_minimum.sizes() == group_scale.sizes(),
              "group_scale and group_minimum: contiguous uint8 (tiles, in / 32, 16)");
  TORCH_CHECK(scale.scalar_type() == at::kHalf && minimum_scale.scalar_type() == at::kHalf && scale.is_contiguous() &&
                  minimum_scale.is_contiguous() && scale.numel() == tiles * (groups / kSuperBlockGroups) * kTile &&
                  minimum_scale.sizes() == scale.sizes(),
              "scale and minimum_scale: contiguous float16 (tiles, in / 256, 16)");
  const uint8_t* sc = group_scale.data_ptr<uint8_t>();
  const uint8_t* mn = group_minimum.data_ptr<uint8_t>();
  const at::Half* d = scale.data_ptr<at::Half>();
  const at::Half* dmin = minimum_scale.data_ptr<at::Half>();
  return dot_product<Tile>(rows, packed, out_features, [&](int64_t t) {
    return SuperBlockScales{sc + t * groups * kTile, mn + t * groups * kTile,
                            d + t * (groups / kSuperBlockGroups) * kTile, dmin + t * (groups / kSuperBlockGroups) * kTile};
  });
}

at::Tensor superblock_product_meta(const at::Tensor& rows, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                    const at::Tensor&, const at::Tensor&, int64_t out_features) {
  return at::empty_symint({rows.sym_size(0), c10::SymInt(out_features)}, rows.options().dtype(at::kFloat));
}

}  // namespace
}  // namespace kvserve

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("superblock4_product(Tensor rows, Tensor packed, Tensor group_scale, Tensor group_minimum, Tensor scale, "
        "Tensor minimum_scale, int out_features) -> Tensor");
  m.def("superblock5_product(Tensor rows, Tensor packed, Tensor group_scale, Tensor group_minimum, Tensor scale, "
        "Tensor minimum_scale, int out_features) -> Tensor");
}
TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("superblock4_product", &kvserve::superblock_product<kvserve::Codes4Tile>);
  m.impl("superblock5_product", &kvserve::superblock_product<kvserve::Codes5Tile>);
}
TORCH_LIBRARY_IMPL(kvserve, Meta, m) {
  m.impl("superblock4_product", &kvserve::superblock_product_meta);
  m.impl("superblock5_product", &kvserve::superblock_product_meta);
}
