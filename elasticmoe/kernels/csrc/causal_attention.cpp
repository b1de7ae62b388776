// Causal attention of prefill spans: each span's queries are the last Nq of its Nk positions
// (Nq = Nk: a whole prompt; Nq < Nk: a chunk over the context before it), query i sees keys up to
// position Nk - Nq + i.
//
// S spans: q [S, Nq, H, Dk] (element strides q_ss, q_sn; heads Dk apart, each contiguous), k [S,
// Nk, Hkv, Dk] and v [S, Nk, Hkv, Dv] (any span, token and head strides; each head contiguous: the
// paged cache's K and V of GQA models, interleaved per token, or an MLA layer's keys and values
// expanded from its latents), out [S, Nq, H, Dv] contiguous. Query head h * G + g (G = H / Hkv)
// reads KV head h.
//
// Why: at prompt lengths of a few hundred tokens PyTorch's CPU paths lose most of the time to
// their shape. SDPA's flash kernel in fp32 ran at ~120 GFLOP/s on 16 spans of 128 tokens (2.2 ms a
// call, ~9% of a fp32 benchmark run); two batched matmuls compute the masked half too and run
// MKL's AVX2 sgemm on AMD hosts. Here each task is one KV head of one span over a block of query
// positions: the keys it needs (those up to its last position) are packed transposed once, so
// scores are register tiles of broadcast query values times key vectors (no horizontal sums),
// then a row-wise softmax, then the probabilities times V rows, all within the causal bound.
//
// Math as the PyTorch path it replaces (layers/attention.py: causal_attention): scores q.k in
// fp32, times `scale`, rounded to the model dtype; softmax in fp32; probabilities rounded to the
// model dtype; the weighted sum of V in fp32, rounded once at the end. fp32 rounds nothing.

#include <math.h>
#include <omp.h>

#include <atomic>
#include <type_traits>
#include <vector>

#include "softmax.h"
#include "vec.h"

namespace {

using namespace emoe;

constexpr int MR = 4;  // query rows (position, head) per register tile
#if defined(EMOE_AVX512)
constexpr int NV_MAX = 6;  // key vectors per score tile: 4 x 6 accumulators + 6 keys of 32 registers
constexpr int DV_MAX = 4;  // value vectors per output tile
#else
constexpr int NV_MAX = 3;  // 4 x 3 + 3 of AVX2's 16
constexpr int DV_MAX = 2;
#endif
// Query positions per task: 64, fewer for long contexts (a task's scores, QB * G rows of its keys,
// stay within ~4 MiB), at least 16. Zen 5, 2 threads, ms per call at 16 / 64 positions: fp32 16
// spans of 128 tokens 1.25 / 1.09, 4 of 512 3.44 / 3.10, one of 2,048 12.7 / 11.6; bf16 pairs 0.95 /
// 0.84, 2.43 / 2.22, 8.0 / 8.0 (each task packs the keys and values it reads: fewer, larger tasks
// pack less per query).
inline int64_t query_block(int64_t Nk, int64_t G) {
  int64_t qb = 64;
  while (qb > 16 && qb * G * Nk * static_cast<int64_t>(sizeof(float)) > (int64_t{4} << 20)) qb /= 2;
  return qb;
}


// s[r][c * L ...] = q[r] . kt[:, c * L ...] * scale, rounded to T's precision, for MR rows and NV
// key vectors from key vector c0.
template <typename T, int NV>
inline void score_tile(const float* q, int64_t D, const float* kt, int64_t ldk, int64_t c0, vec scale, float* s,
                       int64_t lds) {
  const T* const as = nullptr;
  vec acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c] = vzero();
  const float* k = kt + c0 * L;
  for (int64_t d = 0; d < D; ++d, k += ldk) {
    vec kv[NV];
    for (int c = 0; c < NV; ++c) kv[c] = vload(k + c * L);
    for (int r = 0; r < MR; ++r) {
      const vec qv = vset(q[r * D + d]);
      for (int c = 0; c < NV; ++c) acc[r][c] = vfma(qv, kv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NV; ++c) vstore(s + r * lds + (c0 + c) * L, round_vec(as, vmul(acc[r][c], scale)));
}

// f(std::integral_constant<int, n>{}): a tile width n (1 .. NV_MAX) as a template argument.
template <typename F>
inline void with_width(int64_t n, F f) {
  switch (n) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
#if defined(EMOE_AVX512)
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
#endif
  }
}

// s[r][0 : nvec * L] for MR rows, NV_MAX key vectors at a time.
template <typename T>
inline void score_tiles(const float* q, int64_t D, const float* kt, int64_t ldk, int64_t nvec, vec scale, float* s,
                        int64_t lds) {
  for (int64_t c0 = 0; c0 < nvec; c0 += NV_MAX)
    with_width(nvec - c0 < NV_MAX ? nvec - c0 : NV_MAX,
               [&](auto nv) { score_tile<T, decltype(nv)::value>(q, D, kt, ldk, c0, scale, s, lds); });
}

// o[r][d0 ...] = sum_j p[r][j] v[j][d0 ...] for MR rows, DV vectors of D from d0, keys j < nk.
template <int DV>
inline void value_tile(const float* p, int64_t ldp, const float* v, int64_t D, int64_t d0, int64_t nk, float* o) {
  vec acc[MR][DV];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < DV; ++c) acc[r][c] = vzero();
  for (int64_t j = 0; j < nk; ++j) {
    vec vv[DV];
    for (int c = 0; c < DV; ++c) vv[c] = vload(v + j * D + d0 + c * L);
    for (int r = 0; r < MR; ++r) {
      const vec pv = vset(p[r * ldp + j]);
      for (int c = 0; c < DV; ++c) acc[r][c] = vfma(pv, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < DV; ++c) vstore(o + r * D + d0 + c * L, acc[r][c]);
}

inline void value_tiles(const float* p, int64_t ldp, const float* v, int64_t D, int64_t nk, float* o) {
  for (int64_t d0 = 0; d0 < D; d0 += DV_MAX * L) {
    const int64_t left = (D - d0) / L;
    if (left >= DV_MAX) {
      value_tile<DV_MAX>(p, ldp, v, D, d0, nk, o);
    } else if (left >= 2) {
      value_tile<2>(p, ldp, v, D, d0, nk, o);
      if (left == 3) value_tile<1>(p, ldp, v, D, d0 + 2 * L, nk, o);
    } else {
      value_tile<1>(p, ldp, v, D, d0, nk, o);
    }
  }
}

// p[0:n] = softmax(p[0:n]) in fp32, rounded to T's precision; p[n:end] = 0 (read by value tiles).
template <typename T>
inline void causal_softmax(float* p, int64_t n, int64_t end, const T* as) {
  softmax_inplace(p, n, as);
  for (int64_t t = n; t < end; ++t) p[t] = 0.0f;
}

// kt[d * ldk + j] = k_j[d] in fp32 for keys j < nk (k_j = k + j * ld_in), zeros up to ldk.
template <typename T>
inline void pack_keys(const T* k, int64_t ld_in, int64_t nk, int64_t D, float* kt, int64_t ldk) {
  int64_t j = 0;
#if defined(EMOE_AVX512)
  for (; j + 16 <= nk; j += 16) {  // 16 keys x 16 values at a time, transposed in registers
    for (int64_t d = 0; d < D; d += 16) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm512_castps_si512(vload(k + (j + i) * ld_in + d));
      transpose16x16(r);
      for (int i = 0; i < 16; ++i) _mm512_storeu_si512(kt + (d + i) * ldk + j, r[i]);
    }
  }
#endif
  for (; j < nk; ++j)
    for (int64_t d = 0; d < D; ++d) kt[d * ldk + j] = scalar(k + j * ld_in, d);
  for (int64_t d = 0; d < D; ++d)
    for (int64_t t = nk; t < ldk; ++t) kt[d * ldk + t] = 0.0f;
}

// A task's buffers are thread_local, kept between calls: a prefill calls this once per layer, and
// buffers of a few MB allocated per call came back as fresh pages, whose first-touch faults are
// slow on a VM. What a thread keeps is set by the longest context it attended to: its keys and
// values, 2 * D * context * 4 bytes, and its scores, ~4 MiB (more only where query_block is down to
// 16 positions): ~8 MB at 8,192 tokens of the small model.

// One task: KV head h of span s over queries [p0, p1). Its G * (p1 - p0) rows are (position, head)
// pairs, row r = (p0 + r / G, head h * G + r % G); key bound of row r: first + p0 + r / G + 1.
struct Task {
  int64_t s, h, p0, p1;
};

// One call's tensors (see the top of the file).
template <typename T>
struct Call {
  const T* q;
  int64_t q_ss, q_sn;
  const T* k;
  int64_t k_ss, k_sn, k_sh;
  const T* v;
  int64_t v_ss, v_sn, v_sh;
  int64_t S, Nq, Nk, H, Hkv, Dk, Dv;
  T* out;

  int64_t G() const { return H / Hkv; }
  int64_t first() const { return Nk - Nq; }  // the position of query 0
  const T* q_rows(const Task& t, int64_t p) const { return q + t.s * q_ss + p * q_sn + t.h * G() * Dk; }
  const T* keys(const Task& t) const { return k + t.s * k_ss + t.h * k_sh; }      // key j at + j * k_sn
  const T* values(const Task& t) const { return v + t.s * v_ss + t.h * v_sh; }  // value j at + j * v_sn
};

// task(t) for each KV head of each span and each block of qb queries, on the kernel's threads:
// the last query blocks (the most keys) first, so the cheap ones even out the threads' ends.
template <typename Run>
void for_each_task(int64_t S, int64_t Hkv, int64_t Nq, int64_t qb, Run run) {
  const int64_t blocks = (Nq + qb - 1) / qb;
  const int64_t heads = S * Hkv;
  std::atomic<int64_t> next_task{0};
#pragma omp parallel num_threads(num_threads())
  for (int64_t task; (task = next_task.fetch_add(1, std::memory_order_relaxed)) < blocks * heads;) {
    const int64_t block = blocks - 1 - task / heads;
    const int64_t p0 = block * qb;
    run(Task{task % heads / Hkv, task % Hkv, p0, p0 + qb < Nq ? p0 + qb : Nq});
  }
}

// Where a tile of rows r0 .. r0 + MR - 1 stops reading keys: its last row's bound (a padded row
// past the last one counts as that row).
inline int64_t tile_keys(int64_t r0, int64_t rows, int64_t G, int64_t first, int64_t p0) {
  const int64_t last = r0 + MR - 1 < rows ? r0 + MR - 1 : rows - 1;
  return first + p0 + last / G + 1;
}

// The probabilities of a tile's rows (scores in place, nvec * L of them per row): each valid row
// softmaxed up to its bound, every other value 0.
template <typename T>
inline void tile_softmax(float* ps, int64_t ldk, int64_t r0, int64_t rows, int64_t G, int64_t first, int64_t p0,
                         int64_t nvec) {
  const T* const as = nullptr;
  for (int64_t r = r0; r < r0 + MR; ++r) {
    float* pr = ps + r * ldk;
    if (r < rows)
      causal_softmax(pr, first + p0 + r / G + 1, nvec * L, as);
    else
      for (int64_t j = 0; j < nvec * L; ++j) pr[j] = 0.0f;
  }
}

// Rows [r0, r0 + MR) of a task from o [MR, Dv] into out [S, Nq, H, Dv].
template <typename T>
inline void store_rows(const float* o, const Task& t, int64_t r0, int64_t rows, const Call<T>& c) {
  const int64_t G = c.G(), D = c.Dv;
  for (int64_t r = r0; r < r0 + MR && r < rows; ++r) {
    T* dst = c.out + ((t.s * c.Nq + t.p0 + r / G) * c.H + t.h * G + r % G) * D;
    for (int64_t d = 0; d < D; d += L) vstore_as(dst + d, vload(o + (r - r0) * D + d));
  }
}

// A task in fp32 arithmetic: keys packed transposed [Dk, ldk], values as fp32 rows.
template <typename T>
void fp32_task(const Task& t, const Call<T>& c, vec scale) {
  thread_local std::vector<float> qs, kt, vs, ps;  // queries [rows, Dk], keys [Dk, ldk], values [nk, Dv], probs [rows, ldk]
  const int64_t G = c.G(), Dk = c.Dk, Dv = c.Dv, first = c.first();
  const int64_t nk = first + t.p1;  // keys 0 .. first + p1 - 1
  const int64_t ldk = (nk + L - 1) / L * L;
  const int64_t rows = (t.p1 - t.p0) * G, padded = (rows + MR - 1) / MR * MR;
  qs.assign(padded * Dk, 0.0f);
  kt.resize(Dk * ldk);
  vs.resize(nk * Dv);
  ps.resize(padded * ldk);
  for (int64_t p = t.p0; p < t.p1; ++p) {  // the block's queries, G heads per position
    const T* qp = c.q_rows(t, p);
    for (int64_t i = 0; i < G * Dk; i += L) vstore(qs.data() + (p - t.p0) * G * Dk + i, vload(qp + i));
  }
  pack_keys(c.keys(t), c.k_sn, nk, Dk, kt.data(), ldk);
  for (int64_t j = 0; j < nk; ++j) {
    const T* vj = c.values(t) + j * c.v_sn;
    for (int64_t d = 0; d < Dv; d += L) vstore(vs.data() + j * Dv + d, vload(vj + d));
  }
  for (int64_t r0 = 0; r0 < padded; r0 += MR) {
    const int64_t keys = tile_keys(r0, rows, G, first, t.p0);
    const int64_t nvec = (keys + L - 1) / L;
    float* pt = ps.data() + r0 * ldk;
    score_tiles<T>(qs.data() + r0 * Dk, Dk, kt.data(), ldk, nvec, scale, pt, ldk);
    tile_softmax<T>(ps.data(), ldk, r0, rows, G, first, t.p0, nvec);
    float o[MR * 8 * 16];  // MR rows of up to 128 fp32 values (Dv <= 128, checked by the caller)
    value_tiles(pt, ldk, vs.data(), Dv, keys, o);
    store_rows(o, t, r0, rows, c);
  }
}

#if defined(EMOE_BF16DOT)
// bf16 on vdpbf16ps, 32 multiply-adds per instruction (twice fp32's FMA): the products of bf16
// values are exact in fp32 and accumulate in fp32, so only the summation order differs from
// fp32_task. Scores take pairs along D (keys packed as [D / 2, ldk] dwords, each a key's two
// adjacent values: a 16 x 16 dword transpose per 16 keys), the weighted sum pairs along the keys
// (values packed as [keys / 2, D] dwords, each the values of two adjacent keys at one d; the
// rounded probabilities kept as bf16, so two adjacent ones are one dword).

// kp[i * ldk + j] = (k_j[2i], k_j[2i + 1]) for keys j < nk, zeros up to ldk. D % 32 == 0.
inline void pack_key_pairs(const uint16_t* k, int64_t ld_in, int64_t nk, int64_t D, uint32_t* kp, int64_t ldk) {
  int64_t j = 0;
  for (; j + 16 <= nk; j += 16) {
    for (int64_t i0 = 0; i0 < D / 2; i0 += 16) {
      __m512i r[16];
      for (int a = 0; a < 16; ++a) r[a] = _mm512_loadu_si512(k + (j + a) * ld_in + 2 * i0);
      transpose16x16(r);
      for (int a = 0; a < 16; ++a) _mm512_storeu_si512(kp + (i0 + a) * ldk + j, r[a]);
    }
  }
  for (; j < nk; ++j)
    for (int64_t i = 0; i < D / 2; ++i) memcpy(kp + i * ldk + j, k + j * ld_in + 2 * i, 4);
  for (int64_t i = 0; i < D / 2; ++i)
    for (int64_t t = nk; t < ldk; ++t) kp[i * ldk + t] = 0;
}

// vp[u * D + d] = (v_{2u}[d], v_{2u + 1}[d]) for pairs u < ceil(nk / 2) (a missing last key: 0).
inline void pack_value_pairs(const uint16_t* v, int64_t ld_in, int64_t nk, int64_t D, uint32_t* vp) {
  for (int64_t u = 0; 2 * u < nk; ++u) {
    const uint16_t* a = v + 2 * u * ld_in;
    const uint16_t* b = 2 * u + 1 < nk ? a + ld_in : nullptr;
    for (int64_t d = 0; d < D; d += 16) {
      const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + d)));
      const __m512i hi = b != nullptr
          ? _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + d))), 16)
          : _mm512_setzero_si512();
      _mm512_storeu_si512(vp + u * D + d, _mm512_or_si512(lo, hi));
    }
  }
}

template <int NV>
inline void score_tile_pairs(const uint16_t* q, int64_t D, const uint32_t* kp, int64_t ldk, int64_t c0, vec scale,
                             float* s, int64_t lds) {
  __m512 acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_setzero_ps();
  const uint32_t* k = kp + c0 * 16;
  for (int64_t i = 0; i < D / 2; ++i, k += ldk) {
    __m512bh kv[NV];
    for (int c = 0; c < NV; ++c) kv[c] = (__m512bh)_mm512_loadu_si512(k + c * 16);
    for (int r = 0; r < MR; ++r) {
      int32_t pair;
      memcpy(&pair, q + r * D + 2 * i, 4);
      const __m512bh qv = (__m512bh)_mm512_set1_epi32(pair);
      for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], qv, kv[c]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NV; ++c) vstore(s + r * lds + (c0 + c) * 16, vround_bf16(_mm512_mul_ps(acc[r][c], scale)));
}

inline void score_tiles_pairs(const uint16_t* q, int64_t D, const uint32_t* kp, int64_t ldk, int64_t nvec, vec scale,
                              float* s, int64_t lds) {
  for (int64_t c0 = 0; c0 < nvec; c0 += NV_MAX)
    with_width(nvec - c0 < NV_MAX ? nvec - c0 : NV_MAX,
               [&](auto nv) { score_tile_pairs<decltype(nv)::value>(q, D, kp, ldk, c0, scale, s, lds); });
}

// o[r][d0 ...] = sum_u (p[r][2u] v_{2u} + p[r][2u + 1] v_{2u + 1})[d0 ...] for MR rows, DV vectors.
template <int DV>
inline void value_tile_pairs(const uint16_t* p, int64_t ldp, const uint32_t* vp, int64_t D, int64_t d0, int64_t pairs,
                             float* o) {
  __m512 acc[MR][DV];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < DV; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t u = 0; u < pairs; ++u) {
    __m512bh vv[DV];
    for (int c = 0; c < DV; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(vp + u * D + d0 + c * 16);
    for (int r = 0; r < MR; ++r) {
      int32_t pair;
      memcpy(&pair, p + r * ldp + 2 * u, 4);
      const __m512bh pv = (__m512bh)_mm512_set1_epi32(pair);
      for (int c = 0; c < DV; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pv, vv[c]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < DV; ++c) vstore(o + r * D + d0 + c * 16, acc[r][c]);
}

inline void value_tiles_pairs(const uint16_t* p, int64_t ldp, const uint32_t* vp, int64_t D, int64_t pairs, float* o) {
  for (int64_t d0 = 0; d0 < D; d0 += DV_MAX * 16) {
    if ((D - d0) / 16 >= DV_MAX)
      value_tile_pairs<DV_MAX>(p, ldp, vp, D, d0, pairs, o);
    else
      value_tile_pairs<2>(p, ldp, vp, D, d0, pairs, o);  // D % 32 == 0: what is left is two vectors
  }
}

void pair_task(const Task& t, const Call<uint16_t>& c, vec scale) {
  thread_local std::vector<uint16_t> qs, pb;  // queries [rows, Dk], probabilities [rows, ldk]
  thread_local std::vector<uint32_t> kp, vp;  // key pairs [Dk / 2, ldk], value pairs [ceil(nk / 2), Dv]
  thread_local std::vector<float> ps;         // scores, then probabilities [rows, ldk]
  const int64_t G = c.G(), Dk = c.Dk, Dv = c.Dv, first = c.first();
  const int64_t nk = first + t.p1;
  const int64_t ldk = (nk + 15) / 16 * 16;
  const int64_t rows = (t.p1 - t.p0) * G, padded = (rows + MR - 1) / MR * MR;
  qs.assign(padded * Dk, 0);
  kp.resize(Dk / 2 * ldk);
  vp.resize((nk + 1) / 2 * Dv);
  ps.resize(padded * ldk);
  pb.resize(padded * ldk);
  for (int64_t p = t.p0; p < t.p1; ++p)
    memcpy(qs.data() + (p - t.p0) * G * Dk, c.q_rows(t, p), G * Dk * sizeof(uint16_t));
  pack_key_pairs(c.keys(t), c.k_sn, nk, Dk, kp.data(), ldk);
  pack_value_pairs(c.values(t), c.v_sn, nk, Dv, vp.data());
  for (int64_t r0 = 0; r0 < padded; r0 += MR) {
    const int64_t keys = tile_keys(r0, rows, G, first, t.p0);
    const int64_t nvec = (keys + 15) / 16;
    score_tiles_pairs(qs.data() + r0 * Dk, Dk, kp.data(), ldk, nvec, scale, ps.data() + r0 * ldk, ldk);
    tile_softmax<uint16_t>(ps.data(), ldk, r0, rows, G, first, t.p0, nvec);
    for (int64_t r = r0; r < r0 + MR; ++r)  // already rounded to bf16: the high halves are the values
      for (int64_t j = 0; j < nvec * 16; j += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb.data() + r * ldk + j),
                            _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(vload(ps.data() + r * ldk + j)), 16)));
    float o[MR * 8 * 16];
    value_tiles_pairs(pb.data() + r0 * ldk, ldk, vp.data(), Dv, (keys + 1) / 2, o);
    store_rows(o, t, r0, rows, c);
  }
}
#endif

template <typename T>
void causal_attention(const Call<T>& c, float scale) {
  const int64_t qb = query_block(c.Nk, c.G());
  const vec scale_v = vset(scale);
#if defined(EMOE_BF16DOT)
  if constexpr (sizeof(T) == 2) {
    if (c.Dk % 32 == 0 && c.Dv % 32 == 0) {
      for_each_task(c.S, c.Hkv, c.Nq, qb, [&](const Task& t) { pair_task(t, c, scale_v); });
      return;
    }
  }
#endif
  for_each_task(c.S, c.Hkv, c.Nq, qb, [&](const Task& t) { fp32_task(t, c, scale_v); });
}

}  // namespace

extern "C" {

void emoe_set_num_threads(int n) { emoe::g_num_threads = n; }

// dtype: 0 = float32, 1 = bfloat16 (q, k, v and out alike). Strides in elements. Returns 0, or -1
// where the kernel does not serve the call (another dtype; Dk or Dv not a multiple of the vector
// width, or Dv over 128; H not a multiple of Hkv; fewer keys than queries): nothing is written then.
int emoe_causal_attention(const void* q, int64_t q_ss, int64_t q_sn, const void* k, int64_t k_ss, int64_t k_sn,
                          int64_t k_sh, const void* v, int64_t v_ss, int64_t v_sn, int64_t v_sh, int64_t S, int64_t Nq,
                          int64_t Nk, int64_t H, int64_t Hkv, int64_t Dk, int64_t Dv, float scale, int dtype,
                          void* out) {
  using emoe::L;
  if (Dk <= 0 || Dk % L != 0 || Dv <= 0 || Dv % L != 0 || Dv > 128 || Hkv <= 0 || H % Hkv != 0 || Nk < Nq) return -1;
  if (S <= 0 || Nq <= 0) return 0;
  const auto run = [&](auto* typed_out) {
    using T = std::remove_pointer_t<decltype(typed_out)>;
    const Call<T> c{static_cast<const T*>(q), q_ss, q_sn, static_cast<const T*>(k), k_ss, k_sn, k_sh,
                    static_cast<const T*>(v), v_ss, v_sn, v_sh, S, Nq, Nk, H, Hkv, Dk, Dv, typed_out};
    causal_attention(c, scale);
  };
  if (dtype == emoe::kF32) {
    run(static_cast<float*>(out));
  } else if (dtype == emoe::kBF16) {
    run(static_cast<uint16_t*>(out));
  } else {
    return -1;
  }
  return 0;
}

}  // extern "C"
