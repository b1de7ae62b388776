// The dot kernel of the grouped GEMM: outputs as dot products along K, the checkpoint's layout.
//
// A block of NB weight rows and MB input rows is kept in registers and its accumulators are reduced
// once per block. Decode (a few rows per expert) is bound by reading the weights once; this layout
// reads them once, straight from the memory the caller owns. grouped_gemm.cpp runs it for fp32
// weights, for bf16 weights where no AMX tiles are granted, for decode-size calls on AVX2 (more
// rows per slot go to packed panels), and for the last rows (fewer than 16) of an AMX call.
#pragma once

#include <cstdint>

#include "vec.h"

namespace emoe::dot {

constexpr int NB = 8;  // weight rows per block
// Input rows per block: MB * NB accumulators + MB inputs + 1 weight fit AVX-512's 32 registers. AVX2
// has 16: there a block of 2-3 input rows runs as two halves of 4 weight rows (12 accumulators;
// with all 8, 28 vectors spilled to the stack), see dot_rows.
constexpr int MB = 3;

// dst[0:N] = the horizontal sums of v[0:N] plus tails[0:N], in x's dtype (N: 8, or 4 on AVX2).
template <int N, typename X>
inline void store_sums(const vec* v, const float* tails, X* dst) {
  if constexpr (N == 8) {
    store8(dst, _mm256_add_ps(hsum8v(v), _mm256_loadu_ps(tails)));
  } else {
#if defined(EMOE_AVX2)
    store4(dst, _mm_add_ps(hsum4v(v), _mm_loadu_ps(tails)));
#endif
  }
}

// Whether a block of N weight rows stores its sums straight into dst.
template <int N>
constexpr bool kStoresWhole = N == 8 || (N == 4 && L == 8);

// out[m][n] = x[m, 0:K] . w[n, 0:K] for a block of M (<= MB) input rows and N (<= NB) weight rows;
// whole blocks (kStoresWhole<N>) are stored straight into `dst` (row stride ldo), others into `out`.
template <typename X, typename W, int M, int N>
inline void dot_block(const X* x, int64_t ldx, const W* w, int64_t ldw, int64_t K, float out[MB][NB], X* dst,
                      int64_t ldo, const W* pf = nullptr) {
  vec acc[M][N];
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) acc[m][n] = vzero();
  int64_t k = 0;
  const int64_t kv = K - K % L;
#if defined(EMOE_BF16DOT)
  if constexpr (sizeof(X) == 2 && sizeof(W) == 2) {
    // Native bf16 pairs: one vdpbf16ps does 32 multiply-adds.
    const int64_t k2 = K - K % 32;
    for (; k < k2; k += 32) {
      if (pf != nullptr)  // the next weight block, one line per row per step, spread over the compute
        for (int n = 0; n < N; ++n) _mm_prefetch(reinterpret_cast<const char*>(pf + n * ldw + k), _MM_HINT_T0);
      __m512bh xv[M];
      for (int m = 0; m < M; ++m) xv[m] = (__m512bh)_mm512_loadu_si512(x + m * ldx + k);
      for (int n = 0; n < N; ++n) {
        __m512bh wv = (__m512bh)_mm512_loadu_si512(w + n * ldw + k);
        for (int m = 0; m < M; ++m) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], xv[m], wv);
      }
    }
  }
#endif
  for (; k < kv; k += L) {
    if (pf != nullptr && (k * static_cast<int64_t>(sizeof(W))) % 64 == 0)
      for (int n = 0; n < N; ++n) _mm_prefetch(reinterpret_cast<const char*>(pf + n * ldw + k), _MM_HINT_T0);
    vec xv[M];
    for (int m = 0; m < M; ++m) xv[m] = vload(x + m * ldx + k);
    for (int n = 0; n < N; ++n) {
      vec wv = vload(w + n * ldw + k);
      for (int m = 0; m < M; ++m) acc[m][n] = vfma(xv[m], wv, acc[m][n]);
    }
  }
  const int64_t tail = kv > k ? kv : k;
  for (int m = 0; m < M; ++m) {
    if constexpr (kStoresWhole<N>) {
      float tails[N] = {};
      for (int n = 0; n < N; ++n)
        for (int64_t t = tail; t < K; ++t) tails[n] += scalar(x, m * ldx + t) * scalar(w, n * ldw + t);
      store_sums<N>(acc[m], tails, dst + m * ldo);
    } else {
      for (int n = 0; n < N; ++n) {
        out[m][n] = hsum(acc[m][n]);
        for (int64_t t = tail; t < K; ++t) out[m][n] += scalar(x, m * ldx + t) * scalar(w, n * ldw + t);
      }
    }
  }
}

// Rows [r0, r1) of x times weight rows [0, nb) of wb (nb <= NB) -> out[r0:r1, 0:nb] (out points at
// the block's first output column). `pf`: the next weight block of the same slot, pulled into
// cache while the first rows compute (or null).
template <typename X, typename W>
void dot_rows(const X* x, int64_t ldx, int64_t r0, int64_t r1, const W* wb, int64_t ldw, int nb, int64_t K, X* out,
              int64_t ldo, const W* pf) {
  float acc[MB][NB];
  for (int64_t r = r0; r < r1; r += MB) {
    const int mb = static_cast<int>(r1 - r < MB ? r1 - r : MB);
    const X* xb = x + r * ldx;
    X* dst = out + r * ldo;
    const W* p = r == r0 ? pf : nullptr;
#if defined(EMOE_AVX2)
    if (nb == NB && mb > 1) {  // two halves of 4 weight rows (16 registers), each prefetching its half
      const W* p2 = p != nullptr ? p + 4 * ldw : nullptr;
      if (mb == 3) {
        dot_block<X, W, 3, 4>(xb, ldx, wb, ldw, K, acc, dst, ldo, p);
        dot_block<X, W, 3, 4>(xb, ldx, wb + 4 * ldw, ldw, K, acc, dst + 4, ldo, p2);
      } else {
        dot_block<X, W, 2, 4>(xb, ldx, wb, ldw, K, acc, dst, ldo, p);
        dot_block<X, W, 2, 4>(xb, ldx, wb + 4 * ldw, ldw, K, acc, dst + 4, ldo, p2);
      }
      continue;
    }
#endif
    if (nb == NB) {
      if (mb == 3)
        dot_block<X, W, 3, NB>(xb, ldx, wb, ldw, K, acc, dst, ldo, p);
      else if (mb == 2)
        dot_block<X, W, 2, NB>(xb, ldx, wb, ldw, K, acc, dst, ldo, p);
      else
        dot_block<X, W, 1, NB>(xb, ldx, wb, ldw, K, acc, dst, ldo, p);
      continue;
    }
    for (int n = 0; n < nb; ++n) {  // a partial block of weight rows: one row at a time
      float one[MB][NB];
      const W* wn = wb + n * ldw;
      if (mb == 3)
        dot_block<X, W, 3, 1>(xb, ldx, wn, ldw, K, one, dst, ldo);
      else if (mb == 2)
        dot_block<X, W, 2, 1>(xb, ldx, wn, ldw, K, one, dst, ldo);
      else
        dot_block<X, W, 1, 1>(xb, ldx, wn, ldw, K, one, dst, ldo);
      for (int m = 0; m < mb; ++m) acc[m][n] = one[m][0];
    }
    for (int m = 0; m < mb; ++m)
      for (int n = 0; n < nb; ++n) store(dst, m * ldo + n, acc[m][n]);
  }
}

// Rows [r0, r1) of x times `ncols` weight rows from w, NB at a time, into out[:, 0:ncols]. While a
// block's first rows compute, the next NB weight rows are pulled in (contiguous): a block's rows
// are short streams the hardware prefetchers barely start on (decode, weights from DRAM, one
// thread: 1.25 -> 0.87 ms per layer at 8 rows per slot). Only within the `avail` weight rows of
// the slot from w on: another slot's rows may be unmapped adapter memory.
template <typename X, typename W>
void dot_cols(const X* x, int64_t ldx, int64_t r0, int64_t r1, const W* w, int64_t ldw, int64_t ncols, int64_t avail,
              int64_t K, X* out, int64_t ldo) {
  for (int64_t j = 0; j < ncols; j += NB) {
    const W* wj = w + j * ldw;
    const W* pf = j + 2 * NB <= avail ? wj + NB * ldw : nullptr;
    dot_rows(x, ldx, r0, r1, wj, ldw, static_cast<int>(ncols - j < NB ? ncols - j : NB), K, out + j, ldo, pf);
  }
}

}  // namespace emoe::dot
