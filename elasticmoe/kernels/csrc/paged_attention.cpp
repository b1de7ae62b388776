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

#include <atomic>
#include <vector>

#include "softmax.h"
#include "vec.h"

namespace {

using namespace emoe;

inline __m256 round8_as(const float*, __m256 v) { return v; }
inline __m256 round8_as(const uint16_t*, __m256 v) { return round8_bf16(v); }

template <typename T>
inline float dot(const T* a, const T* b, int64_t D) {
  vec acc = vzero();
  int64_t d = 0;
  for (; d + L <= D; d += L) acc = vfma(vload(a + d), vload(b + d), acc);
  float s = hsum(acc);
  for (; d < D; ++d) s += scalar(a, d) * scalar(b, d);
  return s;
}

// (a . rows[j]) for 8 rows, as one vector (a single reduction for all eight: hsum8v).
template <typename T>
inline __m256 dot8(const T* a, const T* const* rows, int64_t D) {
#if defined(EMOE_BF16DOT)
  if constexpr (sizeof(T) == 2) {
    if (D % 32 == 0) {  // native bf16 pairs, no widening
      __m512 acc[8];
      for (int j = 0; j < 8; ++j) acc[j] = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; d += 32) {
        const __m512bh av = (__m512bh)_mm512_loadu_si512(a + d);
        for (int j = 0; j < 8; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], av, (__m512bh)_mm512_loadu_si512(rows[j] + d));
      }
      return hsum8v(acc);
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
  __m256 sums = hsum8v(acc);
  if (d < D) {
    float tail[8] = {};
    for (int j = 0; j < 8; ++j)
      for (int64_t e = d; e < D; ++e) tail[j] += scalar(a, e) * scalar(rows[j], e);
    sums = _mm256_add_ps(sums, _mm256_loadu_ps(tail));
  }
  return sums;
}

// f(first token, its slot, tokens) for each block of a sequence's first `ctx` tokens, in order.
template <typename F>
inline void for_each_block(const int64_t* blocks, int64_t ctx, int64_t block_size, F f) {
  for (int64_t t0 = 0, i = 0; t0 < ctx; t0 += block_size, ++i)
    f(t0, blocks[i] * block_size, ctx - t0 < block_size ? ctx - t0 : block_size);
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
    for_each_block(blocks, ctx, block_size, [&](int64_t t0, int64_t slot0, int64_t n) {
      for (int64_t i = 0; i < n; ++i) {
        const T* v = vbase + (slot0 + i) * slot_stride;
        vec vv[NV];
        for (int j = 0; j < NV; ++j) vv[j] = vload(v + j * L);
        for (int g = 0; g < HG; ++g) {
          const vec p = vset(probs[(g0 + g) * ctx + t0 + i]);
          for (int j = 0; j < NV; ++j) a[g][j] = vfma(p, vv[j], a[g][j]);
        }
      }
    });
    for (int g = 0; g < HG; ++g)
      for (int j = 0; j < NV; ++j) vstore(acc + (g0 + g) * NV * L + j * L, a[g][j]);
  }
}

// The cache lines of one sequence's blocks (K and V of every head), handed out a few at a time to
// be prefetched while the sequence before it computes: its blocks are scattered over the pool,
// and the lines asked for all at once filled the core's miss buffers and stalled the compute.
template <typename T>
class LinePrefetcher {
 public:
  void start(const T* cache, const int64_t* blocks, int64_t ctx, int64_t block_size, int64_t slot_stride) {
    cache_ = reinterpret_cast<const char*>(cache);
    blocks_ = blocks;
    block_bytes_ = block_size * slot_stride * static_cast<int64_t>(sizeof(T));
    num_blocks_ = (ctx + block_size - 1) / block_size;
    block_ = 0;
    offset_ = 0;
  }
  void stop() { block_ = num_blocks_; }
  void next(int lines) {
    for (; lines > 0 && block_ < num_blocks_; --lines) {
      _mm_prefetch(cache_ + blocks_[block_] * block_bytes_ + offset_, _MM_HINT_T1);
      if ((offset_ += 64) >= block_bytes_) offset_ = 0, ++block_;
    }
  }
  void rest() { next(1 << 30); }

 private:
  const char* cache_ = nullptr;
  const int64_t* blocks_ = nullptr;
  int64_t block_bytes_ = 0, num_blocks_ = 0, block_ = 0, offset_ = 0;
};

template <typename T>
void decode_attention(const T* q, int64_t q_stride_b, const T* cache, const int64_t* block_table, int64_t max_blocks,
                      const int64_t* context_lens, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t block_size,
                      float scale, T* out) {
  const int64_t G = H / Hkv;
  const int64_t slot_stride = 2 * Hkv * D;  // one token: K heads then V heads
  const T* null = nullptr;
  const __m256 scale8 = _mm256_set1_ps(scale);
  // Lines of the next sequence to prefetch per 8 keys scored: a sequence of ctx tokens has
  // ctx * slot_stride * sizeof(T) / 64 lines and Hkv * ctx / 8 groups of 8 keys.
  const int lines_per_group = static_cast<int>((8 * slot_stride * static_cast<int64_t>(sizeof(T)) / 64 + Hkv - 1) / Hkv) + 1;
  std::atomic<int64_t> next_seq{0};
#pragma omp parallel num_threads(num_threads())
  {
    std::vector<float> probs;  // [G, ctx]
    std::vector<float> acc;    // [G, D]
    LinePrefetcher<T> prefetch;
    // Sequences are claimed one ahead: while one computes, the next one's blocks come in.
    int64_t b = next_seq.fetch_add(1, std::memory_order_relaxed);
    if (b < B) {
      prefetch.start(cache, block_table + b * max_blocks, context_lens[b], block_size, slot_stride);
      prefetch.rest();
    }
    while (b < B) {
      const int64_t after = next_seq.fetch_add(1, std::memory_order_relaxed);
      if (after < B)
        prefetch.start(cache, block_table + after * max_blocks, context_lens[after], block_size, slot_stride);
      else
        prefetch.stop();
      const int64_t ctx = context_lens[b];
      const int64_t* blocks = block_table + b * max_blocks;
      for (int64_t h = 0; h < Hkv; ++h) {
        probs.assign(G * ctx, 0.0f);
        acc.assign(G * D, 0.0f);
        const T* qh = q + b * q_stride_b + h * G * D;
        for_each_block(blocks, ctx, block_size, [&](int64_t t0, int64_t slot0, int64_t n) {
          const T* kb = cache + slot0 * slot_stride + h * D;
          int64_t i = 0;
          for (; i + 8 <= n; i += 8) {
            prefetch.next(lines_per_group);
            const T* k[8];
            for (int j = 0; j < 8; ++j) k[j] = kb + (i + j) * slot_stride;
            for (int64_t g = 0; g < G; ++g)
              _mm256_storeu_ps(probs.data() + g * ctx + t0 + i,
                               _mm256_mul_ps(round8_as(null, dot8(qh + g * D, k, D)), scale8));
          }
          for (; i < n; ++i)
            for (int64_t g = 0; g < G; ++g)
              probs[g * ctx + t0 + i] = round_as(null, dot(qh + g * D, kb + i * slot_stride, D)) * scale;
        });
        for (int64_t g = 0; g < G; ++g) softmax_inplace(probs.data() + g * ctx, ctx, null);
        const T* vbase = cache + (Hkv + h) * D;
        if (D == 4 * L && G % 4 == 0) {
          weighted_sum<T, 4>(probs.data(), ctx, G, vbase, blocks, block_size, slot_stride, acc.data());
        } else if (D == 8 * L && G % 2 == 0) {
          weighted_sum<T, 8>(probs.data(), ctx, G, vbase, blocks, block_size, slot_stride, acc.data());
        } else {
          for_each_block(blocks, ctx, block_size, [&](int64_t t0, int64_t slot0, int64_t n) {
            for (int64_t i = 0; i < n; ++i) {
              const T* v = vbase + (slot0 + i) * slot_stride;
              for (int64_t g = 0; g < G; ++g) {
                const float pt = probs[g * ctx + t0 + i];
                float* a = acc.data() + g * D;
                int64_t d = 0;
                const vec pv = vset(pt);
                for (; d + L <= D; d += L) vstore(a + d, vfma(pv, vload(v + d), vload(a + d)));
                for (; d < D; ++d) a[d] += pt * scalar(v, d);
              }
            }
          });
        }
        T* o = out + (b * H + h * G) * D;
        int64_t i = 0;
        for (; i + L <= G * D; i += L) vstore_as(o + i, vload(acc.data() + i));
        for (; i < G * D; ++i) store(o, i, acc[i]);
      }
      prefetch.rest();  // whatever the pacing left (short contexts)
      b = after;
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
