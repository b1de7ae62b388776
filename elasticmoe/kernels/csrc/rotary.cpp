// Rotary position embeddings of a step's q/k heads in one call, with PyTorch's rounding points.
//
//   half rotation (Qwen3, Mixtral; the model dtype):   out = x * cos + roll(x, d / 2) * sin
//       cos [P, d] = (cos, cos), sin [P, d] = (-sin, sin): rotate_half's sign folded into the table.
//       In bf16 each product and the sum are rounded, as three PyTorch ops round them.
//   interleaved pairs (DeepSeek-V2; fp32 tables):      (a, b) -> (a cos - b sin, a sin + b cos)
//       computed in fp32 and rounded once to x's dtype, as `x.float()` ... `.to(dtype)` does.
//
// x: T tokens of H heads of d values (head j of token t at x + t * ldx + j * d), out likewise
// contiguous ([T, H, d]). The PyTorch path costs four to eight ops per layer; at decode sizes each
// costs more in dispatch than in arithmetic. Small inputs run on the calling thread.

// The products and sums must stay separate roundings, as PyTorch's separate ops make them: no
// contraction into FMAs.
#pragma GCC optimize("fp-contract=off")

#include <omp.h>

#include "vec.h"

namespace {

using namespace emoe;

template <typename X>
void rotate_half_row(const X* x, const X* cos, const X* sin, X* out, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < d; ++i) {
    const float rolled = scalar(x, i < half ? i + half : i - half);
    float a = scalar(x, i) * scalar(cos, i), b = rolled * scalar(sin, i);
    if constexpr (sizeof(X) == 2) {
      a = bf16_to_f32(f32_to_bf16(a));
      b = bf16_to_f32(f32_to_bf16(b));
    }
    store(out, i, a + b);
  }
}

template <typename X>
void rotate_half_row_vec(const X* x, const X* cos, const X* sin, X* out, int64_t d) {
  const int64_t half = d / 2;
  if (half % L != 0) {
    rotate_half_row(x, cos, sin, out, d);
    return;
  }
  for (int64_t i = 0; i < half; i += L) {
    const vec lo = vload(x + i), hi = vload(x + half + i);
    vec a = vmul(lo, vload(cos + i)), b = vmul(hi, vload(sin + i));
    vec c = vmul(hi, vload(cos + half + i)), e = vmul(lo, vload(sin + half + i));
    if constexpr (sizeof(X) == 2) {
      a = vround_bf16(a);
      b = vround_bf16(b);
      c = vround_bf16(c);
      e = vround_bf16(e);
    }
    vstore_as(out + i, vadd(a, b));
    vstore_as(out + half + i, vadd(c, e));
  }
}

template <typename X>
void interleaved_row(const X* x, const float* cos, const float* sin, X* out, int64_t d) {
  for (int64_t i = 0; i < d / 2; ++i) {
    const float a = scalar(x, 2 * i), b = scalar(x, 2 * i + 1);
    const float ac = a * cos[i], bs = b * sin[i], as = a * sin[i], bc = b * cos[i];
    store(out, 2 * i, ac - bs);
    store(out, 2 * i + 1, as + bc);
  }
}

template <typename Row>
void for_rows(int64_t T, int64_t H, int64_t d, Row row) {
  if (T * H * d < (1 << 17)) {
    for (int64_t t = 0; t < T; ++t) row(t);
    return;
  }
#pragma omp parallel for schedule(static) num_threads(num_threads())
  for (int64_t t = 0; t < T; ++t) row(t);
}

template <typename X>
int rotary(const X* x, int64_t ldx, int64_t T, int64_t H, int64_t d, const int64_t* positions, int64_t num_positions,
           const void* cos, const void* sin, int interleaved, X* out) {
  for (int64_t t = 0; t < T; ++t)
    if (positions[t] < 0 || positions[t] >= num_positions) return -2;
  if (interleaved) {
    const auto* c = static_cast<const float*>(cos);
    const auto* s = static_cast<const float*>(sin);
    for_rows(T, H, d, [&](int64_t t) {
      const int64_t p = positions[t] * (d / 2);
      for (int64_t j = 0; j < H; ++j) interleaved_row(x + t * ldx + j * d, c + p, s + p, out + (t * H + j) * d, d);
    });
    return 0;
  }
  const auto* c = static_cast<const X*>(cos);
  const auto* s = static_cast<const X*>(sin);
  for_rows(T, H, d, [&](int64_t t) {
    const int64_t p = positions[t] * d;
    for (int64_t j = 0; j < H; ++j) rotate_half_row_vec(x + t * ldx + j * d, c + p, s + p, out + (t * H + j) * d, d);
  });
  return 0;
}

}  // namespace

extern "C" {

void emoe_set_num_threads(int n) { emoe::g_num_threads = n; }

// x_dtype: 0 = float32, 1 = bfloat16. Tables [num_positions, d] in x's dtype (half rotation) or
// [num_positions, d / 2] fp32 (interleaved). Returns 0, -1 for an unsupported dtype or odd d, -2
// for a position outside the tables.
int emoe_rotary(const void* x, int64_t ldx, int x_dtype, int64_t T, int64_t H, int64_t d, const int64_t* positions,
                int64_t num_positions, const void* cos, const void* sin, int interleaved, void* out) {
  if (d % 2 != 0) return -1;
  if (x_dtype == emoe::kF32)
    return rotary(static_cast<const float*>(x), ldx, T, H, d, positions, num_positions, cos, sin, interleaved,
                  static_cast<float*>(out));
  if (x_dtype == emoe::kBF16)
    return rotary(static_cast<const uint16_t*>(x), ldx, T, H, d, positions, num_positions, cos, sin, interleaved,
                  static_cast<uint16_t*>(out));
  return -1;
}

}  // extern "C"
