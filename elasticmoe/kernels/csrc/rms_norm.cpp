// RMSNorm of rows, fused: out = w * (x / sqrt(mean(x^2) + eps)), with HF's rounding points.
//
// x: R rows of C, in groups of `group` consecutive rows (row j of group t at x + t * ldx + j * C: a
// plain matrix with group 1, the heads of each token with group = heads); out likewise with ldo.
// x fp32 or bf16, w [C] fp32 or bf16. The
// norm is computed in fp32 and rounded to x's dtype before the weight multiplies it (as
// `weight * x.float()...to(dtype)` does); the product is rounded to the output dtype (x's, or
// fp32 when a bf16 weight meets fp32 activations). One call instead of eight PyTorch ops; small
// inputs (decode) run on the calling thread: no OpenMP region to wait on.

#include <math.h>
#include <omp.h>

#include <type_traits>

#include "vec.h"

namespace {

using namespace emoe;

template <typename X, typename W, typename O>
void rms_norm_row(const X* x, const W* w, O* out, int64_t C, float eps) {
  vec acc = vzero();
  int64_t c = 0;
  for (; c + L <= C; c += L) {
    const vec v = vload(x + c);
    acc = vfma(v, v, acc);
  }
  float ss = hsum(acc);
  for (; c < C; ++c) ss += scalar(x, c) * scalar(x, c);
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(C) + eps);
  const vec invv = vset(inv);
  for (c = 0; c + L <= C; c += L) {
    vec y = vmul(vload(x + c), invv);
    if constexpr (sizeof(X) == 2) y = vround_bf16(y);
    vstore_as(out + c, vmul(vload(w + c), y));
  }
  for (; c < C; ++c) {
    float y = scalar(x, c) * inv;
    if constexpr (sizeof(X) == 2) y = bf16_to_f32(f32_to_bf16(y));  // .to(dtype) before the weight
    store(out, c, scalar(w, c) * y);
  }
}

template <typename X, typename W, typename O>
void rms_norm(const X* x, int64_t ldx, int64_t group, const W* w, O* out, int64_t ldo, int64_t R, int64_t C,
              float eps) {
  auto row = [&](int64_t r) {
    const int64_t t = r / group, j = r % group;
    rms_norm_row(x + t * ldx + j * C, w, out + t * ldo + j * C, C, eps);
  };
  if (R * C < (1 << 18)) {
    for (int64_t r = 0; r < R; ++r) row(r);
    return;
  }
#pragma omp parallel for schedule(static) num_threads(num_threads())
  for (int64_t r = 0; r < R; ++r) row(r);
}

// sum[r] = round(h[r] + y[r]) (the residual add, rounded to h's dtype as PyTorch's add is), then
// out[r] = the norm of sum[r]: one pass instead of an add and a norm (vLLM's fused_add_rms_norm).
// h, y, sum and out are plain [R, C] matrices of one dtype.
template <typename X, typename W>
void add_rms_norm(const X* h, int64_t ldh, const X* y, int64_t ldy, const W* w, X* sum, int64_t lds, X* out,
                  int64_t ldo, int64_t R, int64_t C, float eps) {
  auto row = [&](int64_t r) {
    const X* hr = h + r * ldh;
    const X* yr = y + r * ldy;
    X* sr = sum + r * lds;
    int64_t c = 0;
    for (; c + L <= C; c += L) vstore_as(sr + c, vadd(vload(hr + c), vload(yr + c)));
    for (; c < C; ++c) store(sr, c, scalar(hr, c) + scalar(yr, c));
    rms_norm_row(static_cast<const X*>(sr), w, out + r * ldo, C, eps);
  };
  if (R * C < (1 << 18)) {
    for (int64_t r = 0; r < R; ++r) row(r);
    return;
  }
#pragma omp parallel for schedule(static) num_threads(num_threads())
  for (int64_t r = 0; r < R; ++r) row(r);
}

}  // namespace

extern "C" {

void emoe_set_num_threads(int n) { emoe::g_num_threads = n; }

// dtypes: 0 = float32, 1 = bfloat16. (x, w) -> out: (f32, f32) -> f32, (bf16, bf16) -> bf16,
// (f32, bf16) -> f32. Returns 0, or -1 for another combination.
int emoe_rms_norm(const void* x, int64_t ldx, int64_t group, int x_dtype, const void* w, int w_dtype, void* out,
                  int64_t ldo, int64_t R, int64_t C, float eps) {
  if (x_dtype == kF32 && w_dtype == kF32) {
    rms_norm(static_cast<const float*>(x), ldx, group, static_cast<const float*>(w), static_cast<float*>(out), ldo, R,
             C, eps);
  } else if (x_dtype == kBF16 && w_dtype == kBF16) {
    rms_norm(static_cast<const uint16_t*>(x), ldx, group, static_cast<const uint16_t*>(w),
             static_cast<uint16_t*>(out), ldo, R, C, eps);
  } else if (x_dtype == kF32 && w_dtype == kBF16) {
    rms_norm(static_cast<const float*>(x), ldx, group, static_cast<const uint16_t*>(w), static_cast<float*>(out), ldo,
             R, C, eps);
  } else {
    return -1;
  }
  return 0;
}

// sum = h + y (rounded to h's dtype), out = rms_norm(sum) * w. dtypes as emoe_rms_norm: (h, w) of
// (f32, f32), (bf16, bf16) or (f32, bf16); y, sum and out have h's dtype. Returns 0, or -1.
int emoe_add_rms_norm(const void* h, int64_t ldh, const void* y, int64_t ldy, int x_dtype, const void* w, int w_dtype,
                      void* sum, int64_t lds, void* out, int64_t ldo, int64_t R, int64_t C, float eps) {
  const auto run = [&](auto* typed_sum, const auto* typed_w) {
    using X = std::remove_pointer_t<decltype(typed_sum)>;
    add_rms_norm(static_cast<const X*>(h), ldh, static_cast<const X*>(y), ldy, typed_w, typed_sum, lds,
                 static_cast<X*>(out), ldo, R, C, eps);
  };
  if (x_dtype == kF32 && w_dtype == kF32) {
    run(static_cast<float*>(sum), static_cast<const float*>(w));
  } else if (x_dtype == kBF16 && w_dtype == kBF16) {
    run(static_cast<uint16_t*>(sum), static_cast<const uint16_t*>(w));
  } else if (x_dtype == kF32 && w_dtype == kBF16) {
    run(static_cast<float*>(sum), static_cast<const uint16_t*>(w));
  } else {
    return -1;
  }
  return 0;
}

}  // extern "C"
