// The attention kernels' softmax over fp32 scores, with the model dtype's rounding of the result
// (paged_attention.cpp for decode, causal_attention.cpp for prefill): one copy of the math that the
// PyTorch paths they replace define (`softmax(dim=-1)` in fp32, then `.to(dtype)`).
#pragma once

#include <math.h>

#include "vec.h"

namespace emoe {

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
  const vec invv = vset(inv);
  for (t = 0; t + L <= n; t += L) vstore(p + t, round_vec(as, vmul(vload(p + t), invv)));
  for (; t < n; ++t) p[t] = round_as(as, p[t] * inv);
}

}  // namespace emoe
