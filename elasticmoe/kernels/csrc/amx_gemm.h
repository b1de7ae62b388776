// The grouped GEMM on AMX tiles, for bf16 weights (built with -DEMOE_AMX).
//
//   out[r, :] = x[r, :] @ w[slot(r)]^T
//
// TDPBF16PS computes C[m][n] += sum_k A[m][k] B[k][n] with A a plain row-major tile (16 rows x 32
// bf16) and B in pairs along K ("VNNI": tile row k2 holds (B[2 k2][n], B[2 k2 + 1][n]) for each
// n). The weights are the A operand, read in place in their checkpoint layout [out, in] (rows
// along K): nothing of them is copied or repacked, so zero-copy HMM stacks and remapped adapter
// rows stay valid, and decode streams each weight once. The activations are the B operand: each
// group's rows are packed once per call into VNNI tiles (a 16 x 16 dword transpose per tile; the
// activations are a few MB at most, the weights up to hundreds). C tiles are [weight rows x
// tokens] and are transposed back into `out`'s rows.
//
// fp32 activations (fp32 compute of a bf16 checkpoint) are split into three bf16 parts,
// x = hi + mid + lo (|x - hi - mid - lo| <= 2^-27 |x|, below fp32's own rounding), accumulated into
// the same C tile: with bf16 weights every product is exact in fp32, so the result is an fp32
// GEMM's up to summation order, at AMX speed.
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>

#include "vec.h"

namespace emoe::amx {

constexpr int TILE_ROWS = 16;                  // weight rows per A tile; K pairs per B tile
constexpr int TILE_K = 32;                     // bf16 values along K per tile row (64 bytes)
constexpr int TILE_ELEMS = TILE_ROWS * TILE_K;  // bf16 values per tile: 1 KiB
constexpr int MAX_PARTS = 3;

// Linux hands out AMX's 8 KiB of tile state only to a process that asks (once, for all its
// threads). PyTorch's oneDNN asks too; asking twice is harmless.
inline bool request_permission() {
  constexpr long kArchReqXcompPerm = 0x1023;
  constexpr long kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

// Every tile 16 rows x 64 bytes. Tile state is per thread: each thread configures its own.
inline void configure_tiles() {
  struct alignas(64) {
    uint8_t palette_id = 1;
    uint8_t start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  } cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = TILE_ROWS;
  }
  _tile_loadconfig(&cfg);
}

// 32 values along K of one activation row as bf16 part `part` (zeros past `valid`).
inline __m512i load_part(const uint16_t* x, int valid, int /*part*/) {
  const __mmask32 m = valid >= 32 ? ~__mmask32(0) : (__mmask32(1) << valid) - 1;
  return _mm512_maskz_loadu_epi16(m, x);
}
inline __m512i load_part(const float* x, int valid, int part) {
  const __mmask16 m0 = valid >= 16 ? __mmask16(0xffff) : __mmask16((1u << (valid > 0 ? valid : 0)) - 1);
  const __mmask16 m1 = valid >= 32 ? __mmask16(0xffff) : __mmask16((1u << (valid > 16 ? valid - 16 : 0)) - 1);
  __m512 a = _mm512_maskz_loadu_ps(m0, x), b = _mm512_maskz_loadu_ps(m1, x + 16);
  // Non-finite values travel whole in `hi` (their remainders would be NaN).
  const __mmask16 fa = _mm512_fpclass_ps_mask(a, 0x99), fb = _mm512_fpclass_ps_mask(b, 0x99);
  for (int p = 0; p < part; ++p) {
    const __m512i h = (__m512i)_mm512_cvtne2ps_pbh(b, a);  // [a as bf16, b as bf16], nearest even
    a = _mm512_maskz_sub_ps(~fa, a, widen(_mm512_castsi512_si256(h)));
    b = _mm512_maskz_sub_ps(~fb, b, widen(_mm512_extracti64x4_epi64(h, 1)));
  }
  return (__m512i)_mm512_cvtne2ps_pbh(b, a);
}

// Rows x[0, rows) (rows <= 16) of K values -> the VNNI B tiles of one token block:
// dst[(kc * parts + p) * TILE_ELEMS] for each K chunk kc, part p; missing tokens and K are zero.
template <typename X>
void pack_token_block(const X* x, int64_t ldx, int rows, int64_t K, int parts, uint16_t* dst) {
  const int64_t num_chunks = (K + TILE_K - 1) / TILE_K;
  __m512i r[16];
  for (int64_t kc = 0; kc < num_chunks; ++kc) {
    const int valid = static_cast<int>(K - kc * TILE_K < TILE_K ? K - kc * TILE_K : TILE_K);
    for (int p = 0; p < parts; ++p) {
      for (int t = 0; t < 16; ++t) r[t] = t < rows ? load_part(x + t * ldx + kc * TILE_K, valid, p) : _mm512_setzero_si512();
      transpose16x16(r);  // r[k2]: the pairs (k = 2 k2, 2 k2 + 1) of tokens 0..15
      uint16_t* tile = dst + (kc * parts + p) * TILE_ELEMS;
      for (int k2 = 0; k2 < 16; ++k2) _mm512_storeu_si512(tile + k2 * TILE_K, r[k2]);
    }
  }
}

// Weight rows [w, w + 16) (and [w + a1, w + a1 + 16) for NA = 2) x activations of NB token blocks
// -> c[a][b] (16 x 16 fp32 each, [weight row][token], at c + 256 * (b + 2 a)). `a1`: elements
// from the first A tile's rows to the second's. `ktail` holds each A tile's last, partial K chunk
// zero-padded (or null). `pf` (or null): the next 16 weight rows (and their `pf_a1` partner block),
// prefetched into L2 row by row over the chunks. Tile registers: A 0-1, B 2-3, C 4-7.
template <int NA, int NB>
inline void tile_block(const uint16_t* w, int64_t ldw, int64_t a1, int64_t num_full_chunks, const uint16_t* ktail,
                       const uint16_t* xp, int64_t token_block_stride, int parts, float* c, const uint16_t* pf = nullptr,
                       int64_t pf_a1 = 0) {
  static_assert(NA >= 1 && NA <= 2 && NB >= 1 && NB <= 2);
  _tile_zero(4);
  if constexpr (NB == 2) _tile_zero(5);
  if constexpr (NA == 2) _tile_zero(6);
  if constexpr (NA == 2 && NB == 2) _tile_zero(7);
  const int64_t num_chunks = num_full_chunks + (ktail != nullptr);
  for (int64_t kc = 0; kc < num_chunks; ++kc) {
    if (pf != nullptr) {
      // `per` whole rows of each of the next block's A regions per chunk, in address order.
      const int64_t per = (TILE_ROWS + num_chunks - 1) / num_chunks;
      for (int64_t i = kc * per; i < (kc + 1) * per && i < TILE_ROWS; ++i)
        for (int a = 0; a < NA; ++a) {
          const char* row = reinterpret_cast<const char*>(pf + a * pf_a1 + i * ldw);
          for (int64_t off = 0; off < num_chunks * 64; off += 64) _mm_prefetch(row + off, _MM_HINT_T1);
        }
    }
    if (kc < num_full_chunks) {
      _tile_loadd(0, w + kc * TILE_K, ldw * 2);
      if constexpr (NA == 2) _tile_loadd(1, w + a1 + kc * TILE_K, ldw * 2);
    } else {
      _tile_loadd(0, ktail, TILE_K * 2);
      if constexpr (NA == 2) _tile_loadd(1, ktail + TILE_ELEMS, TILE_K * 2);
    }
    for (int p = 0; p < parts; ++p) {
      const uint16_t* b = xp + (kc * parts + p) * TILE_ELEMS;
      _tile_loadd(2, b, 64);
      if constexpr (NB == 2) _tile_loadd(3, b + token_block_stride, 64);
      _tile_dpbf16ps(4, 0, 2);
      if constexpr (NB == 2) _tile_dpbf16ps(5, 0, 3);
      if constexpr (NA == 2) _tile_dpbf16ps(6, 1, 2);
      if constexpr (NA == 2 && NB == 2) _tile_dpbf16ps(7, 1, 3);
    }
  }
  _tile_stored(4, c, 64);
  if constexpr (NB == 2) _tile_stored(5, c + 256, 64);
  if constexpr (NA == 2) _tile_stored(6, c + 512, 64);
  if constexpr (NA == 2 && NB == 2) _tile_stored(7, c + 768, 64);
}

// A C tile (16 x 16, [weight row][token]) -> r[t]: token t's 16 outputs.
inline void tile_rows(const float* c, __m512 r[16]) {
  __m512i v[16];
  for (int i = 0; i < 16; ++i) v[i] = _mm512_loadu_si512(c + 16 * i);
  transpose16x16(v);
  for (int t = 0; t < 16; ++t) r[t] = _mm512_castsi512_ps(v[t]);
}

// How a task's C tiles become outputs: `Plain` stores each A tile's 16 outputs per token;
// `SwiGLU` has the gate rows in A tile 0 and the up rows in A tile 1 and stores silu(gate) * up
// (rounded where PyTorch's bf16 path rounds: the two projections, silu, the product).
struct Plain {
  template <typename X>
  static void store(const float* c, int na, int b, int rows, X* out, int64_t ldo) {
    __m512 r[16];
    for (int a = 0; a < na; ++a) {
      tile_rows(c + 256 * (b + 2 * a), r);
      for (int t = 0; t < rows; ++t) vstore_as(out + t * ldo + 16 * a, r[t]);
    }
  }
};
struct SwiGLU {
  template <typename X>
  static void store(const float* c, int, int b, int rows, X* out, int64_t ldo) {
    __m512 gate[16], up[16];
    tile_rows(c + 256 * b, gate);
    tile_rows(c + 256 * (b + 2), up);
    for (int t = 0; t < rows; ++t) {
      if constexpr (sizeof(X) == 2) {
        const __m512 g = vround_bf16(gate[t]);
        vstore_as(out + t * ldo, _mm512_mul_ps(vround_bf16(silu(g)), vround_bf16(up[t])));
      } else {
        vstore_as(out + t * ldo, _mm512_mul_ps(silu(gate[t]), up[t]));
      }
    }
  }
};

// One task: weight rows [w, w + 16) (and [w + a1, w + a1 + 16) for NA = 2) of a slot against all
// `rows` of its group, stored by `Out`.
template <typename Out, typename X, int NA>
void run_rows(const uint16_t* w, int64_t ldw, int64_t a1, int64_t K, const uint16_t* xp, int64_t rows, int parts,
              X* out, int64_t ldo, const uint16_t* pf = nullptr) {
  const int64_t num_full_chunks = K / TILE_K;
  const int64_t tail = K % TILE_K;
  alignas(64) uint16_t ktail[2 * TILE_ELEMS];
  if (tail != 0)
    for (int a = 0; a < NA; ++a)
      for (int i = 0; i < TILE_ROWS; ++i)
        for (int k = 0; k < TILE_K; ++k)
          ktail[a * TILE_ELEMS + i * TILE_K + k] = k < tail ? w[a * a1 + i * ldw + num_full_chunks * TILE_K + k] : 0;
  const int64_t num_chunks = num_full_chunks + (tail != 0);
  const int64_t stride = num_chunks * parts * TILE_ELEMS;  // between token blocks
  alignas(64) float c[4 * 256];
  // Decode-size groups (one token block) pull the next task's weights into L2 while they compute:
  // each A tile reads one line of 16 rows, a pattern the hardware prefetchers barely follow
  // (8 layers' experts, 2 threads, 8 rows per slot: 6.40 -> 6.00 ms first projections, 3.56 ->
  // 3.28 ms second). Longer groups reuse their A tiles per token block; there it cost 12%.
  const uint16_t* next = rows <= 32 ? pf : nullptr;
  for (int64_t t0 = 0; t0 < rows; t0 += 32) {
    const int64_t tb = t0 / 16;
    const int n = static_cast<int>(rows - t0 < 32 ? rows - t0 : 32);
    const uint16_t* kt = tail != 0 ? ktail : nullptr;
    if (n > 16)
      tile_block<NA, 2>(w, ldw, a1, num_full_chunks, kt, xp + tb * stride, stride, parts, c, next, a1);
    else
      tile_block<NA, 1>(w, ldw, a1, num_full_chunks, kt, xp + tb * stride, stride, parts, c, next, a1);
    for (int b = 0; b * 16 < n; ++b)
      Out::store(c, NA, b, n - b * 16 < 16 ? n - b * 16 : 16, out + (t0 + b * 16) * ldo, ldo);
  }
}

}  // namespace emoe::amx
