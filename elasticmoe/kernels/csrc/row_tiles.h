// Rows of a group in tiles of a compile-time height, for the outer-product kernels (packed_panel.h,
// pair_panel.h), whose tiles keep M x 2 accumulators in registers and so need M as a constant.
#pragma once

#include <cstdint>
#include <type_traits>

namespace emoe {

template <int M, typename Tile>
inline void last_row_tile(int rows, int64_t r, Tile& tile) {
  if constexpr (M > 0) {
    if (rows == M)
      tile(std::integral_constant<int, M>{}, r);
    else
      last_row_tile<M - 1>(rows, r, tile);
  }
}

// tile(std::integral_constant<int, M>{}, r) over rows [r0, r1): whole tiles of MR rows from r0, then
// one of the rows left (M < MR).
template <int MR, typename Tile>
inline void for_row_tiles(int64_t r0, int64_t r1, Tile tile) {
  int64_t r = r0;
  for (; r + MR <= r1; r += MR) tile(std::integral_constant<int, MR>{}, r);
  last_row_tile<MR - 1>(static_cast<int>(r1 - r), r, tile);
}

}  // namespace emoe
