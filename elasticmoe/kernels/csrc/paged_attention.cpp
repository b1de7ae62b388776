// Decode attention over the paged KV cache, read in place (no gathered or contiguous copies).
//
// One query token per sequence. For sequence b and KV head h, its G = H / Hkv query heads
// attend to the first context_lens[b] tokens of its blocks:
//   cache [num_slots, 2, Hkv, D] (K then V per token; slot = block * block_size + offset)
//   block_table [B, max_blocks] int64, q [B, H, D] (row stride q_stride_b), out [B, H, D].
//
// The math follows the PyTorch path it replaces (layers/attention.py: decode_attention): scores
// q.k in fp32, rounded to the model dtype (as the bf16 matmul output is), times `scale`;
// softmax in fp32; probabilities rounded to the model dtype; the weighted sum of V in fp32,
// rounded once at the end.

#include <math.h>
#include <omp.h>

#include <vector>

#include "vec.h"

namespace {

using namespace emoe;

inline float round_as(const float*, float v) { return v; }
inline float round_as(const uint16_t*, float v) { return bf16_to_f32(f32_to_bf16(v)); }

template <typename T>
inline float dot(const T* a, const T* b, int64_t D) {
  vec acc = vzero();
  int64_t d = 0;
  for (; d + L <= D; d += L) acc = vfma(vload(a + d), vload(b + d), acc);
  float s = hsum(acc);
  for (; d < D; ++d) s += scalar(a, d) * scalar(b, d);
  return s;
}

// s[j] = a . rows[j] for 8 rows (one reduction for all eight: hsum8).
template <typename T>
inline void dot8(const T* a, const T* const* rows, int64_t D, float* s) {
#if defined(EMOE_BF16DOT)
  if constexpr (sizeof(T) == 2) {
    if (D % 32 == 0) {  // native bf16 pairs, no widening
      __m512 acc[8];
      for (int j = 0; j < 8; ++j) acc[j] = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; d += 32) {
        const __m512bh av = (__m512bh)_mm512_loadu_si512(a + d);
        for (int j = 0; j < 8; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], av, (__m512bh)_mm512_loadu_si512(rows[j] + d));
      }
      hsum8(acc, s);
      return;
    }
  }
#endif
  vec acc[8];
  for (int j = 0; j < 8; ++j) acc[j] = vzero();
  int64_t d = 0;
  for (; d + L <= D; d += L) {
    const vec av = vload(a + d);
    for (int j = 0; j < 8; ++j) acc[j] = vfma(av, vload(rows[j] + d), acc[j]);
  }
  hsum8(acc, s);
  for (; d < D; ++d)
    for (int j = 0; j < 8; ++j) s[j] += scalar(a, d) * scalar(rows[j], d);
}

// p[0:n] = softmax(p[0:n]) in fp32, then rounded to T's precision (as `.to(v.dtype)` does).
template <typename T>
inline void softmax_inplace(float* p, int64_t n, const T* as) {
  vec mv = vset(-INFINITY);
  int64_t t = 0;
  for (; t + L <= n; t += L) mv = vmax(mv, vload(p + t));
  float mx = hmax(mv);
  for (; t < n; ++t) mx = p[t] > mx ? p[t] : mx;
  vec sv = vzero();
  const vec mxv = vset(mx);
  for (t = 0; t + L <= n; t += L) {
    const vec e = vexp_nonpos(vsub(vload(p + t), mxv));
    vstore(p + t, e);
    sv = vadd(sv, e);
  }
  float sum = hsum(sv);
  for (; t < n; ++t) sum += (p[t] = expf(p[t] - mx));
  const float inv = 1.0f / sum;
  for (t = 0; t < n; ++t) p[t] = round_as(as, p[t] * inv);
}

// acc[g, :] = sum_t probs[g, t] * v_t for g < G, D = NV * L: V rows widened once per token, the
// accumulators of HG query heads (16 vectors) kept in registers.
template <typename T, int NV>
inline void weighted_sum(const float* probs, int64_t ctx, int64_t G, const T* vbase, const int64_t* blocks,
                         int64_t block_size, int64_t slot_stride, float* acc) {
  constexpr int HG = 16 / NV;  // query heads per pass
  for (int64_t g0 = 0; g0 < G; g0 += HG) {
    vec a[HG][NV];
    for (int g = 0; g < HG; ++g)
      for (int j = 0; j < NV; ++j) a[g][j] = vzero();
    for (int64_t t = 0; t < ctx; ++t) {
      const T* v = vbase + (blocks[t / block_size] * block_size + t % block_size) * slot_stride;
      vec vv[NV];
      for (int j = 0; j < NV; ++j) vv[j] = vload(v + j * L);
      for (int g = 0; g < HG; ++g) {
        const vec p = vset(probs[(g0 + g) * ctx + t]);
        for (int j = 0; j < NV; ++j) a[g][j] = vfma(p, vv[j], a[g][j]);
      }
    }
    for (int g = 0; g < HG; ++g)
      for (int j = 0; j < NV; ++j) vstore(acc + (g0 + g) * NV * L + j * L, a[g][j]);
  }
}

template <typename T>
void decode_attention(const T* q, int64_t q_stride_b, const T* cache, const int64_t* block_table, int64_t max_blocks,
                      const int64_t* context_lens, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t block_size,
                      float scale, T* out) {
  const int64_t G = H / Hkv;
  const int64_t slot_stride = 2 * Hkv * D;  // one token: K heads then V heads
  const T* null = nullptr;
#pragma omp parallel num_threads(num_threads())
  {
    std::vector<float> probs;  // [G, ctx]
    std::vector<float> acc;    // [G, D]
    // A sequence's KV heads go to one thread in turn: the first head pulls the sequence's blocks
    // (contiguous token slots of all heads) into cache, the others find them there.
#pragma omp for schedule(dynamic, Hkv)
    for (int64_t task = 0; task < B * Hkv; ++task) {
      const int64_t b = task / Hkv, h = task % Hkv;
      const int64_t ctx = context_lens[b];
      const int64_t* blocks = block_table + b * max_blocks;
      probs.assign(G * ctx, 0.0f);
      acc.assign(G * D, 0.0f);
      const T* qh = q + b * q_stride_b + h * G * D;
      int64_t t = 0;
      const int64_t num_blocks = (ctx + block_size - 1) / block_size;
      if (h == 0) {  // the sequence's blocks are scattered: ask for all of them up front (K and V, all heads)
        const int64_t block_bytes = block_size * slot_stride * static_cast<int64_t>(sizeof(T));
        for (int64_t i = 0; i < num_blocks; ++i) {
          const char* p = reinterpret_cast<const char*>(cache + blocks[i] * block_size * slot_stride);
          for (int64_t off = 0; off < block_bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T1);
        }
      }
      for (; t + 8 <= ctx; t += 8) {
        const T* k[8];
        for (int j = 0; j < 8; ++j)
          k[j] = cache + (blocks[(t + j) / block_size] * block_size + (t + j) % block_size) * slot_stride + h * D;
        for (int64_t g = 0; g < G; ++g) {
          float s[8];
          dot8(qh + g * D, k, D, s);
          for (int j = 0; j < 8; ++j) probs[g * ctx + t + j] = round_as(null, s[j]) * scale;
        }
      }
      for (; t < ctx; ++t) {
        const T* k = cache + (blocks[t / block_size] * block_size + t % block_size) * slot_stride + h * D;
        for (int64_t g = 0; g < G; ++g) probs[g * ctx + t] = round_as(null, dot(qh + g * D, k, D)) * scale;
      }
      for (int64_t g = 0; g < G; ++g) softmax_inplace(probs.data() + g * ctx, ctx, null);
      const T* vbase = cache + (Hkv + h) * D;
      if (D == 4 * L && G % 4 == 0) {
        weighted_sum<T, 4>(probs.data(), ctx, G, vbase, blocks, block_size, slot_stride, acc.data());
      } else if (D == 8 * L && G % 2 == 0) {
        weighted_sum<T, 8>(probs.data(), ctx, G, vbase, blocks, block_size, slot_stride, acc.data());
      } else {
        for (int64_t t = 0; t < ctx; ++t) {
          const T* v = vbase + (blocks[t / block_size] * block_size + t % block_size) * slot_stride;
          for (int64_t g = 0; g < G; ++g) {
            const float pt = probs[g * ctx + t];
            float* a = acc.data() + g * D;
            int64_t d = 0;
            const vec pv = vset(pt);
            for (; d + L <= D; d += L) vstore(a + d, vfma(pv, vload(v + d), vload(a + d)));
            for (; d < D; ++d) a[d] += pt * scalar(v, d);
          }
        }
      }
      T* o = out + (b * H + h * G) * D;
      for (int64_t i = 0; i < G * D; ++i) store(o, i, acc[i]);
    }
  }
}

}  // namespace

extern "C" {

void emoe_set_num_threads(int n) { emoe::g_num_threads = n; }

// dtype: 0 = float32, 1 = bfloat16 (q, cache and out alike). Returns 0, or -1 for another dtype.
int emoe_paged_decode_attention(const void* q, int64_t q_stride_b, const void* cache, const int64_t* block_table,
                                int64_t max_blocks, const int64_t* context_lens, int64_t B, int64_t H, int64_t Hkv,
                                int64_t D, int64_t block_size, float scale, int dtype, void* out) {
  if (dtype == kF32) {
    decode_attention(static_cast<const float*>(q), q_stride_b, static_cast<const float*>(cache), block_table,
                     max_blocks, context_lens, B, H, Hkv, D, block_size, scale, static_cast<float*>(out));
  } else if (dtype == kBF16) {
    decode_attention(static_cast<const uint16_t*>(q), q_stride_b, static_cast<const uint16_t*>(cache), block_table,
                     max_blocks, context_lens, B, H, Hkv, D, block_size, scale, static_cast<uint16_t*>(out));
  } else {
    return -1;
  }
  return 0;
}

}  // extern "C"
