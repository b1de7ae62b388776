// Vector helpers shared by the kernels: one build per ISA (-DEMOE_AVX512 or -DEMOE_AVX2).
#pragma once

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

namespace emoe {

// Threads of the kernels' parallel regions (0: OpenMP's default). Set by the engine, so the
// kernels keep every core while PyTorch's own ops of a decode step run on the calling thread.
inline int g_num_threads = 0;
inline int num_threads() { return g_num_threads > 0 ? g_num_threads : omp_get_max_threads(); }

constexpr int kF32 = 0;
constexpr int kBF16 = 1;

inline float bf16_to_f32(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

#if defined(EMOE_AVX512)
using vec = __m512;
constexpr int L = 16;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
// 16 bf16 values as fp32.
inline __m512 widen(__m256i bf16) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16), 16)); }
inline vec vload(const uint16_t* p) { return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline vec vset(float v) { return _mm512_set1_ps(v); }
inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
inline void vstore(float* p, vec v) { _mm512_storeu_ps(p, v); }
inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
inline vec vround(vec v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vec vpow2i(vec p, vec n) { return _mm512_scalef_ps(p, n); }  // p * 2^n
inline float hmax(vec v) { return _mm512_reduce_max_ps(v); }
inline float hsum(vec v) { return _mm512_reduce_add_ps(v); }
// The 8 horizontal sums of v[0..7], in 24 instructions instead of 8 separate reductions (~70).
inline __m256 hsum8v(const vec* v) {
  __m512 x01 = _mm512_add_ps(_mm512_unpacklo_ps(v[0], v[1]), _mm512_unpackhi_ps(v[0], v[1]));
  __m512 x23 = _mm512_add_ps(_mm512_unpacklo_ps(v[2], v[3]), _mm512_unpackhi_ps(v[2], v[3]));
  __m512 x45 = _mm512_add_ps(_mm512_unpacklo_ps(v[4], v[5]), _mm512_unpackhi_ps(v[4], v[5]));
  __m512 x67 = _mm512_add_ps(_mm512_unpacklo_ps(v[6], v[7]), _mm512_unpackhi_ps(v[6], v[7]));
  // per 128-bit lane: partial sums of v0..v3 (and v4..v7)
  __m512 y03 = _mm512_add_ps(_mm512_shuffle_ps(x01, x23, 0x44), _mm512_shuffle_ps(x01, x23, 0xEE));
  __m512 y47 = _mm512_add_ps(_mm512_shuffle_ps(x45, x67, 0x44), _mm512_shuffle_ps(x45, x67, 0xEE));
  // [y03 lanes 0+1, y03 lanes 2+3, y47 lanes 0+1, y47 lanes 2+3]
  __m512 z = _mm512_add_ps(_mm512_shuffle_f32x4(y03, y47, 0x88), _mm512_shuffle_f32x4(y03, y47, 0xDD));
  __m512 t = _mm512_add_ps(z, _mm512_shuffle_f32x4(z, z, 0xB1));  // lanes (0+1, 1+0, 2+3, 3+2)
  // lane 0: v0..v3 totals, lane 2: v4..v7 totals
  return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm512_castps512_ps128(t)), _mm512_extractf32x4_ps(t, 2), 1);
}
#elif defined(EMOE_AVX2)
using vec = __m256;
constexpr int L = 8;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline vec vload(const uint16_t* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline vec vset(float v) { return _mm256_set1_ps(v); }
inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm256_sub_ps(a, b); }
inline void vstore(float* p, vec v) { _mm256_storeu_ps(p, v); }
inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }
inline vec vround(vec v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vec vpow2i(vec p, vec n) {  // p * 2^n, n in [-126, 127] (callers clamp)
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
inline float hmax(vec v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}
inline float hsum(vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline __m256 hsum8v(const vec* v) {
  __m256 x01 = _mm256_add_ps(_mm256_unpacklo_ps(v[0], v[1]), _mm256_unpackhi_ps(v[0], v[1]));
  __m256 x23 = _mm256_add_ps(_mm256_unpacklo_ps(v[2], v[3]), _mm256_unpackhi_ps(v[2], v[3]));
  __m256 x45 = _mm256_add_ps(_mm256_unpacklo_ps(v[4], v[5]), _mm256_unpackhi_ps(v[4], v[5]));
  __m256 x67 = _mm256_add_ps(_mm256_unpacklo_ps(v[6], v[7]), _mm256_unpackhi_ps(v[6], v[7]));
  __m256 y03 = _mm256_add_ps(_mm256_shuffle_ps(x01, x23, 0x44), _mm256_shuffle_ps(x01, x23, 0xEE));
  __m256 y47 = _mm256_add_ps(_mm256_shuffle_ps(x45, x67, 0x44), _mm256_shuffle_ps(x45, x67, 0xEE));
  return _mm256_add_ps(_mm256_permute2f128_ps(y03, y47, 0x20), _mm256_permute2f128_ps(y03, y47, 0x31));
}
// The 4 horizontal sums of v[0..3].
inline __m128 hsum4v(const vec* v) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
#else
#error "build with -DEMOE_AVX512 or -DEMOE_AVX2"
#endif

// exp(x) for x <= 0 (softmax after subtracting the max): 2^n * P(r), x = n ln2 + r, |r| <= ln2 / 2,
// P of degree 6 (relative error ~2e-7, i.e. about 2 ulp).
inline vec vexp_nonpos(vec x) {
  x = vmax(x, vset(-87.0f));
#if defined(EMOE_AVX512)
  const vec n = vround(_mm512_mul_ps(x, vset(1.44269504088896341f)));
  vec r = _mm512_fnmadd_ps(n, vset(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, vset(1.428606765330187045e-06f), r);
#else
  const vec n = vround(_mm256_mul_ps(x, vset(1.44269504088896341f)));
  vec r = _mm256_fnmadd_ps(n, vset(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, vset(1.428606765330187045e-06f), r);
#endif
  vec p = vset(1.0f / 720);
  p = vfma(p, r, vset(1.0f / 120));
  p = vfma(p, r, vset(1.0f / 24));
  p = vfma(p, r, vset(1.0f / 6));
  p = vfma(p, r, vset(0.5f));
  p = vfma(p, r, vset(1.0f));
  p = vfma(p, r, vset(1.0f));
  return vpow2i(p, n);
}

inline void hsum8(const vec* v, float* out) { _mm256_storeu_ps(out, hsum8v(v)); }

// 8 floats' bits plus the round-to-nearest-even increment: the bf16 values are in the high 16 bits.
inline __m256i bf16_rounded_bits8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  return _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
}

// Store 8 floats, rounded to nearest even for bf16 (NaN inputs are not expected here).
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(uint16_t* p, __m256 v) {
  const __m256i r = _mm256_srli_epi32(bf16_rounded_bits8(v), 16);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

// Store 4 floats, rounded to nearest even for bf16.
inline void store4(float* p, __m128 v) { _mm_storeu_ps(p, v); }
inline void store4(uint16_t* p, __m128 v) {
  alignas(16) float f[4];
  _mm_store_ps(f, v);
  for (int i = 0; i < 4; ++i) p[i] = f32_to_bf16(f[i]);
}

// 8 floats rounded to bf16 precision (nearest even), kept as fp32.
inline __m256 round8_bf16(__m256 v) {
  return _mm256_castsi256_ps(_mm256_and_si256(bf16_rounded_bits8(v), _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

#if defined(EMOE_AVX512)
// bf16_rounded_bits8 for 16 floats.
inline __m512i bf16_rounded_bits(vec v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
}

// r[i] (16 dwords each) -> r[j] = (r[0][j], ..., r[15][j]): 64 shuffles.
inline void transpose16x16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {  // pairs of rows interleaved: (r0[4L], r1[4L], r0[4L+1], r1[4L+1]) per lane L
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int g = 0; g < 4; ++g) {  // u[4g + c], lane L: column 4L + c of rows 4g..4g+3
    u[4 * g + 0] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // a 4 x 4 transpose of 128-bit lanes: column 4L + c = lanes L of u[c, 4+c, 8+c, 12+c]
    const __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44);
    const __m512i v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
    const __m512i v3 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
  }
}

// silu(x) = x * sigmoid(x), with exp of a non-positive argument only.
inline __m512 silu(__m512 x) {
  const __m512 e = vexp_nonpos(_mm512_or_ps(x, _mm512_set1_ps(-0.0f)));  // exp(-|x|)
  const __m512 den = _mm512_add_ps(_mm512_set1_ps(1.0f), e);
  const __m512 num = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ), _mm512_set1_ps(1.0f), e);
  return _mm512_div_ps(_mm512_mul_ps(x, num), den);
}
#endif

// v rounded to bf16 precision (nearest even), kept as fp32.
inline vec vround_bf16(vec v) {
#if defined(EMOE_AVX512)
  return _mm512_castsi512_ps(_mm512_and_si512(bf16_rounded_bits(v), _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
#else
  return round8_bf16(v);
#endif
}

// Store one vector (L values) as fp32 or, rounded to nearest even, as bf16 (the rounding of
// vround_bf16, 16 values at a time on AVX-512: one narrowing move instead of two halves packed
// apart; a prefill's bf16 expert outputs stored 10-19% faster in the AMX grouped GEMM. Shifting
// the rounded bits, not masking them first: vround_bf16's mask cost ~3% of a step).
inline void vstore_as(float* p, vec v) { vstore(p, v); }
inline void vstore_as(uint16_t* p, vec v) {
#if defined(EMOE_AVX512)
  const __m512i high = _mm512_srli_epi32(bf16_rounded_bits(v), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(high));
#else
  store8(p, v);
#endif
}

// v as the dtype T holds it (T: float, or uint16_t for bf16), kept as fp32.
inline float round_as(const float*, float v) { return v; }
inline float round_as(const uint16_t*, float v) { return bf16_to_f32(f32_to_bf16(v)); }
inline vec round_vec(const float*, vec v) { return v; }
inline vec round_vec(const uint16_t*, vec v) { return vround_bf16(v); }

inline float scalar(const float* p, int64_t i) { return p[i]; }
inline float scalar(const uint16_t* p, int64_t i) { return bf16_to_f32(p[i]); }
inline void store(float* p, int64_t i, float v) { p[i] = v; }
inline void store(uint16_t* p, int64_t i, float v) { p[i] = f32_to_bf16(v); }

}  // namespace emoe
