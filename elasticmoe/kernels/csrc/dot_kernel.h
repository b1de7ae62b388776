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

// Which weight block a block's passes pull into cache (decode: the weights come from DRAM, and a
// block's rows are short streams the hardware prefetchers barely start on), counted in the order
// the blocks are read: AVX-512, the block read two blocks later, each pass over the input rows
// prefetching its share of its rows; AVX2, the block read next, all of it during the first pass.
// Zen 5, 2 threads, the small model's 8 layers of 32 experts from DRAM at 8 rows per expert, ms
// before / after (in-process alternation): bf16 x bf16 gate/up 4.8 / 3.8-4.1, down 2.4 / 2.1;
// fp32 x fp32 8.8-9.0 / 7.9-8.2 and 4.9 / 3.7; fp32 x bf16 (weights kept in bf16) 4.5-5.5 / 4.4-5.3
// and 3.1-3.3 / 2.8-3.1; the engine's bf16 run (64 x 128 in / 64 out) 2,694-2,742 -> 2,794-2,881
// output tok/s, TPOT 17.0-17.2 -> 15.6-16.4 ms. The AVX2 build on the same host gained in fp32 x
// fp32 and lost in fp32 x bf16 gate/up (6.7 -> 7.2 ms), and AVX2-only hosts were not measured,
// so their build keeps the earlier scheme.
#if defined(EMOE_AVX512)
constexpr int PREFETCH_AHEAD = 2;
#else
constexpr int PREFETCH_AHEAD = 1;
#endif

// Rows [pf0, pf1) of the prefetched block that pass `pass` of `passes` over a block's input rows
// pulls in (none without a block to prefetch).
inline void prefetch_share(bool has_block, int pass, int passes, int& pf0, int& pf1) {
  pf0 = pf1 = 0;
  if (!has_block) return;
  if (PREFETCH_AHEAD == 1) {
    pf1 = pass == 0 ? NB : 0;
  } else {
    pf0 = pass * NB / passes;
    pf1 = (pass + 1) * NB / passes;
  }
}

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
// Meanwhile rows [pf0, pf1) of the weight block `pf` are pulled into cache, a line per row per 64
// bytes of K, spread over the compute.
template <typename X, typename W, int M, int N>
inline void dot_block(const X* x, int64_t ldx, const W* w, int64_t ldw, int64_t K, float out[MB][NB], X* dst,
                      int64_t ldo, const W* pf = nullptr, int pf0 = 0, int pf1 = 0) {
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
      for (int n = pf0; n < pf1; ++n) _mm_prefetch(reinterpret_cast<const char*>(pf + n * ldw + k), _MM_HINT_T0);
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
    if ((k * static_cast<int64_t>(sizeof(W))) % 64 == 0)
      for (int n = pf0; n < pf1; ++n) _mm_prefetch(reinterpret_cast<const char*>(pf + n * ldw + k), _MM_HINT_T0);
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
// the block's first output column). `pf`: the weight block read PREFETCH_AHEAD blocks later (NB
// rows), pulled into cache while this one computes (or null).
template <typename X, typename W>
void dot_rows(const X* x, int64_t ldx, int64_t r0, int64_t r1, const W* wb, int64_t ldw, int nb, int64_t K, X* out,
              int64_t ldo, const W* pf) {
  float acc[MB][NB];
  const int passes = static_cast<int>((r1 - r0 + MB - 1) / MB);
  for (int64_t r = r0; r < r1; r += MB) {
    const int mb = static_cast<int>(r1 - r < MB ? r1 - r : MB);
    const X* xb = x + r * ldx;
    X* dst = out + r * ldo;
    int pf0, pf1;
    prefetch_share(pf != nullptr, static_cast<int>((r - r0) / MB), passes, pf0, pf1);
#if defined(EMOE_AVX2)
    if (nb == NB && mb > 1) {  // two halves of 4 weight rows (16 registers), each prefetching half the share
      const int mid = (pf0 + pf1) / 2;
      if (mb == 3) {
        dot_block<X, W, 3, 4>(xb, ldx, wb, ldw, K, acc, dst, ldo, pf, pf0, mid);
        dot_block<X, W, 3, 4>(xb, ldx, wb + 4 * ldw, ldw, K, acc, dst + 4, ldo, pf, mid, pf1);
      } else {
        dot_block<X, W, 2, 4>(xb, ldx, wb, ldw, K, acc, dst, ldo, pf, pf0, mid);
        dot_block<X, W, 2, 4>(xb, ldx, wb + 4 * ldw, ldw, K, acc, dst + 4, ldo, pf, mid, pf1);
      }
      continue;
    }
#endif
    if (nb == NB) {
      if (mb == 3)
        dot_block<X, W, 3, NB>(xb, ldx, wb, ldw, K, acc, dst, ldo, pf, pf0, pf1);
      else if (mb == 2)
        dot_block<X, W, 2, NB>(xb, ldx, wb, ldw, K, acc, dst, ldo, pf, pf0, pf1);
      else
        dot_block<X, W, 1, NB>(xb, ldx, wb, ldw, K, acc, dst, ldo, pf, pf0, pf1);
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
// block computes, the block PREFETCH_AHEAD blocks on is pulled in (prefetching the next block
// took a layer's decode from 1.25 to 0.87 ms on one thread, AVX2, 8 rows per slot). Only within
// the `avail` weight rows of the slot from w on: another slot's rows may be unmapped adapter memory.
template <typename X, typename W>
void dot_cols(const X* x, int64_t ldx, int64_t r0, int64_t r1, const W* w, int64_t ldw, int64_t ncols, int64_t avail,
              int64_t K, X* out, int64_t ldo) {
  for (int64_t j = 0; j < ncols; j += NB) {
    const W* wj = w + j * ldw;
    const W* pf = j + (PREFETCH_AHEAD + 1) * NB <= avail ? wj + PREFETCH_AHEAD * NB * ldw : nullptr;
    dot_rows(x, ldx, r0, r1, wj, ldw, static_cast<int>(ncols - j < NB ? ncols - j : NB), K, out + j, ldo, pf);
  }
}

}  // namespace emoe::dot
