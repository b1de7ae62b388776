// The bookkeeping around a MoE layer's experts, in one pass each instead of a handful of small
// PyTorch ops (at decode sizes each op costs more in dispatch than in arithmetic):
//
//   emoe_topk          gate probabilities [T, E] -> the k largest per token (and renormalised)
//   emoe_plan_pairs    (token, expert) pairs -> grouped by expert slot (a stable counting sort)
//   emoe_combine       expert outputs of the pairs -> each token's weighted sum
//
// Built once per ISA like the other kernels (only `emoe_combine` is vectorised).

#include <omp.h>

#include "vec.h"

namespace {

using namespace emoe;

// out[t] = sum_j w[t, j] * y[row_of_pair[t * k + j]], each product rounded to Y's precision (as
// PyTorch's `pair_out * weight` is), summed in fp32, rounded once.
template <typename Y>
void combine(const Y* y, int64_t ldy, const int64_t* row_of_pair, const float* w, int64_t T, int k, int64_t H, Y* out,
             int64_t ldo) {
  const bool parallel = T * H * k >= (1 << 18);  // a decode step's few tokens: not worth waking threads
#pragma omp parallel for num_threads(parallel ? num_threads() : 1) schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    Y* o = out + t * ldo;
    int64_t h = 0;
    for (; h + L <= H; h += L) {
      vec acc = vzero();
      for (int j = 0; j < k; ++j) {
        const vec prod = vmul(vset(w[t * k + j]), vload(y + row_of_pair[t * k + j] * ldy + h));
        acc = vadd(acc, sizeof(Y) == 2 ? vround_bf16(prod) : prod);
      }
      vstore_as(o + h, acc);
    }
    for (; h < H; ++h) {
      float acc = 0.0f;
      for (int j = 0; j < k; ++j) {
        const float prod = w[t * k + j] * scalar(y, row_of_pair[t * k + j] * ldy + h);
        acc += sizeof(Y) == 2 ? bf16_to_f32(f32_to_bf16(prod)) : prod;
      }
      store(o, h, acc);
    }
  }
}

}  // namespace

extern "C" {

void emoe_set_num_threads(int n) { emoe::g_num_threads = n; }

// probs [T, E] (row stride ldp) -> the k largest of each row, largest first, equal values by
// lower expert id: weights [T, k] (divided by their sum when `renormalize`), ids [T, k].
int emoe_topk(const float* probs, int64_t ldp, int64_t T, int64_t E, int k, int renormalize, float* weights,
              int64_t* ids) {
  if (k < 1 || k > E || k > 64) return -1;
  const bool parallel = T * E >= (1 << 14);  // a prefill's thousands of tokens: ~0.5 ms per layer on one thread
#pragma omp parallel for num_threads(parallel ? num_threads() : 1) schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    const float* p = probs + t * ldp;
    float* w = weights + t * k;
    int64_t* id = ids + t * k;
    int n = 0;  // w[0:n] sorted descending (insertion into the k best so far)
    for (int64_t e = 0; e < E; ++e) {
      const float v = p[e];
      if (n == k && !(v > w[k - 1])) continue;  // NaN never displaces
      int i = n < k ? n++ : k - 1;
      for (; i > 0 && v > w[i - 1]; --i) {
        w[i] = w[i - 1];
        id[i] = id[i - 1];
      }
      w[i] = v;
      id[i] = e;
    }
    if (renormalize) {
      float sum = 0.0f;
      for (int j = 0; j < k; ++j) sum += w[j];
      for (int j = 0; j < k; ++j) w[j] /= sum;
    }
  }
  return 0;
}

// The T * k pairs of `ids` [T, k] grouped by their expert's slot (`expert_to_slot` [E]), in pair
// order within a slot: row i of the grouped order is pair order[i], of token order[i] / k.
// Writes pair_of_row (that order), token_of_row, slot_of_row (ascending), row_of_pair (the
// inverse permutation), each [T * k], and offsets [num_slots + 1]. Returns 0, or -1 for an expert
// id or slot out of range.
int emoe_plan_pairs(const int64_t* ids, int64_t T, int k, const int64_t* expert_to_slot, int64_t num_experts,
                    int64_t num_slots, int64_t* pair_of_row, int64_t* token_of_row, int64_t* slot_of_row,
                    int64_t* row_of_pair, int64_t* offsets) {
  const int64_t n = T * k;
  for (int64_t s = 0; s <= num_slots; ++s) offsets[s] = 0;
  for (int64_t p = 0; p < n; ++p) {
    const int64_t e = ids[p];
    if (e < 0 || e >= num_experts) return -1;
    const int64_t s = expert_to_slot[e];
    if (s < 0 || s >= num_slots) return -1;
    ++offsets[s + 1];
  }
  for (int64_t s = 0; s < num_slots; ++s) offsets[s + 1] += offsets[s];
  for (int64_t p = 0; p < n; ++p) {  // offsets[s] runs ahead as slot s fills, then is restored below
    const int64_t s = expert_to_slot[ids[p]];
    const int64_t row = offsets[s]++;
    pair_of_row[row] = p;
    token_of_row[row] = p / k;
    slot_of_row[row] = s;
    row_of_pair[p] = row;
  }
  for (int64_t s = num_slots; s > 0; --s) offsets[s] = offsets[s - 1];
  offsets[0] = 0;
  return 0;
}

// out [T, H] (row stride ldo) = per token the sum of its k pairs' rows of y [T * k, H] (row stride
// ldy), weighted by weights [T, k] (fp32). dtype (y and out): 0 = float32, 1 = bfloat16.
int emoe_combine(const void* y, int64_t ldy, int dtype, const int64_t* row_of_pair, const float* weights, int64_t T,
                 int k, int64_t H, void* out, int64_t ldo) {
  if (dtype == emoe::kF32) {
    combine(static_cast<const float*>(y), ldy, row_of_pair, weights, T, k, H, static_cast<float*>(out), ldo);
  } else if (dtype == emoe::kBF16) {
    combine(static_cast<const uint16_t*>(y), ldy, row_of_pair, weights, T, k, H, static_cast<uint16_t*>(out), ldo);
  } else {
    return -1;
  }
  return 0;
}

}  // extern "C"
