// Outer-product GEMM tiles over a panel of bf16 pairs, for bf16 groups of many rows on AVX-512
// with bf16 dot products (`vdpbf16ps`) and no AMX tiles.
//
// The dot kernel (dot_kernel.h) multiplies along K, the checkpoint's layout, and reduces every
// output horizontally once per block: right for decode, where reading the weights once is what
// counts, but with many rows per slot (prefill) the reductions cost ~20% of a K = 512 projection
// and ~40% of a K = 256 one (Zen 5, 2 threads, 256 rows per expert: 613 and 480 GFLOP/s against
// oneDNN's 735-800 for one large bf16 GEMM). Here a task copies 32 weight rows into a panel of
// [K / 2][32] dwords, each the pair (w[j, 2p], w[j, 2p + 1]) that `vdpbf16ps` multiplies with a
// broadcast pair of one input row (a 16 x 16 dword transpose per 16 rows and 16 pairs; per-thread
// AlignedBuffer, no persistent copy: the weights stay where the caller has them). Then every 12
// rows of the group run against it: per pair, two panel vectors and twelve broadcasts feed 24
// `vdpbf16ps` into 24 accumulators, and no output needs a horizontal sum.
//
// The panel's two halves of 16 columns may come from anywhere: 32 consecutive weight rows
// (`Plain`), or 16 gate rows and the same 16 up rows of an expert (`SwiGLU`, which stores
// silu(gate) * up rounded where PyTorch's bf16 path rounds, as the AMX kernel does).
#pragma once

#include <cstdint>
#include <cstring>

#include "row_tiles.h"
#include "vec.h"

#if defined(EMOE_BF16DOT)
namespace emoe::pair_panel {

constexpr int NR = 32;  // panel columns: two vectors of 16
constexpr int MR = 12;  // input rows per tile: 24 accumulators + 2 panel vectors + 1 broadcast of 32 registers

// Dwords of a panel for K: ceil(K / 2) pairs of NR columns.
inline int64_t panel_dwords(int64_t K) { return (K + 1) / 2 * NR; }

// The pair (row[2p], row[2p + 1]) as one dword, 0 past K.
inline uint32_t pair(const uint16_t* row, int64_t p, int64_t K) {
  const uint32_t hi = 2 * p + 1 < K ? row[2 * p + 1] : 0;
  return row[2 * p] | hi << 16;
}

// bp[p * NR + 16 h + i] = pair p of weight row i of half h (rows half[h] + i * ldw, i < nb[h]), 0
// for i >= nb[h]. bp is 64-byte aligned.
inline void pack(const uint16_t* const half[2], const int nb[2], int64_t ldw, int64_t K, uint32_t* bp) {
  const int64_t P = (K + 1) / 2;
  const int64_t P16 = K / 32 * 16;  // pairs in whole chunks of 16 (32 values of every row)
  for (int h = 0; h < 2; ++h) {
    const uint16_t* w = half[h];
    uint32_t* col = bp + 16 * h;
    int64_t p = 0;
    if (nb[h] == 16) {
      for (; p < P16; p += 16) {
        __m512i r[16];
        for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(w + i * ldw + 2 * p);
        transpose16x16(r);  // r[c]: pair p + c of the 16 rows
        for (int c = 0; c < 16; ++c) _mm512_store_si512(col + (p + c) * NR, r[c]);
      }
    }
    for (; p < P; ++p)
      for (int i = 0; i < 16; ++i) col[p * NR + i] = i < nb[h] ? pair(w + i * ldw, p, K) : 0;
  }
}

// How a tile's accumulators become outputs: acc[m][0] holds the panel's columns 0..15 of input
// row m, acc[m][1] columns 16..31.
struct Plain {  // the 32 columns are `nb` consecutive outputs
  static void store(const __m512 acc[2], uint16_t* dst, int nb) {
    if (nb == NR) {
      vstore_as(dst, acc[0]);
      vstore_as(dst + 16, acc[1]);
      return;
    }
    alignas(64) float row[NR];
    _mm512_store_ps(row, acc[0]);
    _mm512_store_ps(row + 16, acc[1]);
    for (int n = 0; n < nb; ++n) emoe::store(dst, n, row[n]);
  }
};
struct SwiGLU {  // columns 0..15: gate, 16..31: up of the same `nb` outputs
  static void store(const __m512 acc[2], uint16_t* dst, int nb) {
    const __m512 h = _mm512_mul_ps(vround_bf16(silu(vround_bf16(acc[0]))), vround_bf16(acc[1]));
    if (nb == 16) {
      vstore_as(dst, h);
      return;
    }
    alignas(64) float row[16];
    _mm512_store_ps(row, h);
    for (int n = 0; n < nb; ++n) emoe::store(dst, n, row[n]);
  }
};

// M (<= MR) input rows of x (bf16, row stride ldx) against the panel -> Out::store per row.
template <typename Out, int M>
inline void tile(const uint16_t* x, int64_t ldx, const uint32_t* bp, int64_t K, uint16_t* dst, int64_t ldo, int nb) {
  __m512 acc[M][2];
  for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  const int64_t whole = K / 2;
  for (int64_t p = 0; p < whole; ++p) {
    const __m512bh w0 = (__m512bh)_mm512_load_si512(bp + p * NR);
    const __m512bh w1 = (__m512bh)_mm512_load_si512(bp + p * NR + 16);
    for (int m = 0; m < M; ++m) {
      uint32_t xp;
      std::memcpy(&xp, x + m * ldx + 2 * p, 4);
      const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int>(xp));
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], b, w0);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], b, w1);
    }
  }
  if (K % 2 != 0) {  // the last value alone: its pair's upper half is 0 in the panel and here
    const __m512bh w0 = (__m512bh)_mm512_load_si512(bp + whole * NR);
    const __m512bh w1 = (__m512bh)_mm512_load_si512(bp + whole * NR + 16);
    for (int m = 0; m < M; ++m) {
      const __m512bh b = (__m512bh)_mm512_set1_epi32(x[m * ldx + K - 1]);
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], b, w0);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], b, w1);
    }
  }
  for (int m = 0; m < M; ++m) Out::store(acc[m], dst + m * ldo, nb);
}

// Rows [r0, r1) of x against one panel -> out[r, 0:nb].
template <typename Out>
void rows(const uint16_t* x, int64_t ldx, int64_t r0, int64_t r1, const uint32_t* bp, int nb, int64_t K, uint16_t* out,
          int64_t ldo) {
  for_row_tiles<MR>(r0, r1, [&](auto m, int64_t r) {
    tile<Out, decltype(m)::value>(x + r * ldx, ldx, bp, K, out + r * ldo, ldo, nb);
  });
}

}  // namespace emoe::pair_panel
#endif
