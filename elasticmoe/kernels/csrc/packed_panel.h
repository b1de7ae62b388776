// Outer-product GEMM tiles over a packed fp32 weight panel, for groups of many rows computed in
// fp32 FMAs (every build; bf16 ones on AVX-512 with bf16 dot products use pair_panel.h).
//
// The dot kernel (dot_kernel.h) multiplies along K, the checkpoint's layout, and reduces each
// output horizontally: right for decode, where a few rows share each weight and reading the
// weights once is what counts. With many rows per slot (prefill) it is bound by those reductions
// (and on AVX2, whose 16 registers hold few accumulators, by re-reading its inputs for every 4
// weight rows). Here a task copies NR weight rows
// into a panel transposed to [K][NR] fp32 (widened once, in a per-thread AlignedBuffer of NR * K
// floats: no persistent copy, the weights stay where the caller has them), then every MR rows of
// the group run against it: per k, two panel vectors and MR broadcast inputs feed 2 MR FMAs into
// 2 MR accumulators (AVX2: 16 columns, 6 rows; AVX-512: 32 columns, 12 rows). Each output is one
// fp32 FMA chain along k, as in a plain GEMM.
#pragma once

#include <cstdint>

#include "row_tiles.h"
#include "vec.h"

namespace emoe::panel {

constexpr int NR = 2 * L;  // weight rows (output columns) per panel: two vectors
#if defined(EMOE_AVX512)
constexpr int MR = 12;  // input rows per tile: 24 accumulators + 2 panel vectors + 1 broadcast of 32 registers
#else
constexpr int MR = 6;  // input rows per tile: 12 accumulators + 2 panel vectors + 1 broadcast of 16 registers
#endif

#if defined(EMOE_AVX512)
// bp[k * NR + j] = w[j, k] as fp32 for j < nb (<= NR), 0 for nb <= j < NR: per half of 16 rows, a
// 16 x 16 transpose per 16 values of K.
template <typename W>
void pack(const W* w, int64_t ldw, int nb, int64_t K, float* bp) {
  const int64_t k16 = K - K % 16;
  for (int half = 0; half < 2; ++half) {
    const int j0 = half * 16;
    int64_t k = 0;
    if (nb >= j0 + 16) {
      for (; k < k16; k += 16) {
        __m512i r[16];
        for (int j = 0; j < 16; ++j) r[j] = _mm512_castps_si512(vload(w + (j0 + j) * ldw + k));
        transpose16x16(r);
        for (int i = 0; i < 16; ++i) _mm512_store_si512(bp + (k + i) * NR + j0, r[i]);
      }
    }
    for (; k < K; ++k)
      for (int j = 0; j < 16; ++j) bp[k * NR + j0 + j] = j0 + j < nb ? scalar(w, (j0 + j) * ldw + k) : 0.0f;
  }
}
#else
// Transposes 8 vectors (rows) in place into 8 columns.
inline void transpose8(__m256 r[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
  r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
  r[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
  r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
  r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
  r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
  r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
  r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

// bp[k * NR + j] = w[j, k] as fp32 for j < nb (<= NR), 0 for nb <= j < NR.
template <typename W>
void pack(const W* w, int64_t ldw, int nb, int64_t K, float* bp) {
  const int64_t k8 = K - K % 8;
  for (int half = 0; half < 2; ++half) {
    const int j0 = half * 8;
    if (nb >= j0 + 8) {
      for (int64_t k = 0; k < k8; k += 8) {
        __m256 r[8];
        for (int j = 0; j < 8; ++j) r[j] = vload(w + (j0 + j) * ldw + k);
        transpose8(r);
        for (int i = 0; i < 8; ++i) _mm256_store_ps(bp + (k + i) * NR + j0, r[i]);
      }
      for (int64_t k = k8; k < K; ++k)
        for (int j = 0; j < 8; ++j) bp[k * NR + j0 + j] = scalar(w, (j0 + j) * ldw + k);
    } else {
      for (int64_t k = 0; k < K; ++k)
        for (int j = 0; j < 8; ++j) bp[k * NR + j0 + j] = j0 + j < nb ? scalar(w, (j0 + j) * ldw + k) : 0.0f;
    }
  }
}
#endif

// dst[m, 0:nb] = x[m, 0:K] @ panel for M (<= MR) rows; dst in x's dtype (bf16 rounded to nearest even).
template <typename X, int M>
inline void tile(const X* x, int64_t ldx, const float* bp, int64_t K, X* dst, int64_t ldo, int nb) {
  vec acc[M][2];
  for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = vzero();
  for (int64_t k = 0; k < K; ++k) {
    const vec w0 = vload(bp + k * NR), w1 = vload(bp + k * NR + L);
    for (int m = 0; m < M; ++m) {
      const vec b = vset(scalar(x, m * ldx + k));
      acc[m][0] = vfma(b, w0, acc[m][0]);
      acc[m][1] = vfma(b, w1, acc[m][1]);
    }
  }
  for (int m = 0; m < M; ++m) {
    if (nb == NR) {
      vstore_as(dst + m * ldo, acc[m][0]);
      vstore_as(dst + m * ldo + L, acc[m][1]);
    } else {
      alignas(64) float row[NR];
      vstore(row, acc[m][0]);
      vstore(row + L, acc[m][1]);
      for (int n = 0; n < nb; ++n) store(dst, m * ldo + n, row[n]);
    }
  }
}

// Rows [r0, r1) of x against one packed panel of nb weight rows -> out[r, 0:nb].
template <typename X>
void rows(const X* x, int64_t ldx, int64_t r0, int64_t r1, const float* bp, int nb, int64_t K, X* out, int64_t ldo) {
  for_row_tiles<MR>(r0, r1, [&](auto m, int64_t r) {
    tile<X, decltype(m)::value>(x + r * ldx, ldx, bp, K, out + r * ldo, ldo, nb);
  });
}

}  // namespace emoe::panel
