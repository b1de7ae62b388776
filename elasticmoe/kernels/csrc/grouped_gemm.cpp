// Grouped GEMM over stacked expert weights, read in place (no repacking).
//
//   out[r, :] = x[r, :] @ w[slot(r)]^T      rows of x grouped by slot: offsets[s]..offsets[s+1]
//
// With `slot_rows` (nullable), slot s computes with weight row slot_rows[s] instead of w[s]: an
// expert cache's groups (experts in local order) read whichever pool rows hold them, without
// permuting the input rows into pool-row order and back.
//
// x [N, K] (fp32 or bf16), w [E, Nout, K] (fp32 or bf16, any expert/row stride, unit column
// stride), out [N, Nout] in x's dtype. Slots without rows are never read, so a virtual weight
// tensor whose adapter rows are mapped on demand is safe. Accumulation is in fp32; bf16 outputs
// are rounded to nearest even, as oneDNN does.
//
// The weight layout [Nout, K] (K contiguous) is the checkpoint's: each output is a dot product
// along K, so the kernel keeps a block of NB weight rows and MB input rows in registers and
// reduces the accumulators once per block. Decode (a few rows per expert) is bound by reading
// the weights once; this layout reads them once, straight from the memory the caller owns.
//
// Built once per ISA (the Python side picks the build from elasticmoe.utils.cpu_features):
//   -DEMOE_AVX512 [-DEMOE_BF16DOT]   or   -DEMOE_AVX2
// Threads: OpenMP, i.e. PyTorch's own runtime (torch is loaded first; same libgomp soname).

#include <omp.h>

#include <atomic>

#include "vec.h"

namespace {

using namespace emoe;

constexpr int NB = 8;  // weight rows per block
constexpr int MB = 3;  // input rows per block: MB * NB accumulators + MB inputs + 1 weight <= 32 registers
// The next unclaimed task of one thread's run, alone on its cache line (the threads claim often).
struct alignas(64) Cursor {
  std::atomic<int64_t> next{0};
};

constexpr int TASK_COST_ROWS = 4;  // a task's cost beyond its rows, for balancing: streaming its weight block

// out[m][n] = x[m, 0:K] . w[n, 0:K] for a block of M (<= MB) input rows and N (<= NB) weight rows;
// full blocks (N == NB) are stored straight into `dst` (row stride ldo), partial ones into `out`.
template <typename X, typename W, int M, int N>
inline void dot_block(const X* x, int64_t ldx, const W* w, int64_t ldw, int64_t K, float out[MB][NB], X* dst,
                      int64_t ldo, const W* pf = nullptr) {
  vec acc[M][N];
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) acc[m][n] = vzero();
  int64_t k = 0;
  const int64_t kv = K - K % L;
#if defined(EMOE_BF16DOT)
  if constexpr (sizeof(X) == 2 && sizeof(W) == 2) {
    // Native bf16 pairs: one vdpbf16ps does 32 multiply-adds.
    const int64_t k2 = K - K % 32;
    for (; k < k2; k += 32) {
      if (pf != nullptr)  // the next weight block, one line per row per step, spread over the compute
        for (int n = 0; n < N; ++n) _mm_prefetch(reinterpret_cast<const char*>(pf + n * ldw + k), _MM_HINT_T0);
      __m512bh xv[M];
      for (int m = 0; m < M; ++m) xv[m] = (__m512bh)_mm512_loadu_si512(x + m * ldx + k);
      for (int n = 0; n < N; ++n) {
        __m512bh wv = (__m512bh)_mm512_loadu_si512(w + n * ldw + k);
        for (int m = 0; m < M; ++m) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], xv[m], wv);
      }
    }
  }
#endif
  for (; k < kv; k += L) {
    if (pf != nullptr && (k * static_cast<int64_t>(sizeof(W))) % 64 == 0)
      for (int n = 0; n < N; ++n) _mm_prefetch(reinterpret_cast<const char*>(pf + n * ldw + k), _MM_HINT_T0);
    vec xv[M];
    for (int m = 0; m < M; ++m) xv[m] = vload(x + m * ldx + k);
    for (int n = 0; n < N; ++n) {
      vec wv = vload(w + n * ldw + k);
      for (int m = 0; m < M; ++m) acc[m][n] = vfma(xv[m], wv, acc[m][n]);
    }
  }
  const int64_t tail = kv > k ? kv : k;
  for (int m = 0; m < M; ++m) {
    if constexpr (N == 8) {
      __m256 sums = hsum8v(acc[m]);
      if (tail < K) {
        float t8[8] = {};
        for (int n = 0; n < N; ++n)
          for (int64_t t = tail; t < K; ++t) t8[n] += scalar(x, m * ldx + t) * scalar(w, n * ldw + t);
        sums = _mm256_add_ps(sums, _mm256_loadu_ps(t8));
      }
      store8(dst + m * ldo, sums);
    } else {
      for (int n = 0; n < N; ++n) {
        out[m][n] = hsum(acc[m][n]);
        for (int64_t t = tail; t < K; ++t) out[m][n] += scalar(x, m * ldx + t) * scalar(w, n * ldw + t);
      }
    }
  }
}

template <typename X, typename W>
void grouped_gemm(const X* x, int64_t ldx, const int64_t* offsets, const int64_t* slot_rows, int num_slots,
                  const W* w, int64_t w_stride_e, int64_t w_stride_n, X* out, int64_t ldo, int64_t n_out, int64_t K) {
  // Tasks: (slot, block of NB weight rows), only for slots with rows.
  const int64_t blocks_per_slot = (n_out + NB - 1) / NB;
  int64_t num_busy = 0;
  for (int s = 0; s < num_slots; ++s) num_busy += offsets[s + 1] > offsets[s];
  int* busy = new int[num_busy > 0 ? num_busy : 1];
  for (int s = 0, i = 0; s < num_slots; ++s)
    if (offsets[s + 1] > offsets[s]) busy[i++] = s;
  const int64_t num_tasks = num_busy * blocks_per_slot;
  const auto run_task = [&](int64_t task) {
    const int slot = busy[task / blocks_per_slot];
    const int64_t n0 = (task % blocks_per_slot) * NB;
    const int nb = static_cast<int>(n_out - n0 < NB ? n_out - n0 : NB);
    const int64_t row = slot_rows != nullptr ? slot_rows[slot] : slot;
    const W* wb = w + row * w_stride_e + n0 * w_stride_n;
    float acc[MB][NB];
    for (int64_t r = offsets[slot]; r < offsets[slot + 1]; r += MB) {
      const int mb = static_cast<int>(offsets[slot + 1] - r < MB ? offsets[slot + 1] - r : MB);
      const X* xb = x + r * ldx;
      X* dst = out + r * ldo + n0;
      // While the first rows compute, pull in the next weight block of this slot (its next NB
      // rows, contiguous): each task's NB rows are short streams the hardware prefetchers barely
      // start on (decode, weights from DRAM, one thread: 1.25 -> 0.87 ms per layer at 8 rows per
      // slot). Only within the slot: another slot's rows may be unmapped adapter memory.
      const W* pf = (r == offsets[slot] && n0 + 2 * NB <= n_out) ? wb + NB * w_stride_n : nullptr;
      if (nb == NB) {
        if (mb == 3)
          dot_block<X, W, 3, NB>(xb, ldx, wb, w_stride_n, K, acc, dst, ldo, pf);
        else if (mb == 2)
          dot_block<X, W, 2, NB>(xb, ldx, wb, w_stride_n, K, acc, dst, ldo, pf);
        else
          dot_block<X, W, 1, NB>(xb, ldx, wb, w_stride_n, K, acc, dst, ldo, pf);
        continue;
      } else {  // the last, partial block of weight rows: one row at a time
        for (int n = 0; n < nb; ++n) {
          float one[MB][NB];
          const W* wn = wb + n * w_stride_n;
          if (mb == 3)
            dot_block<X, W, 3, 1>(xb, ldx, wn, w_stride_n, K, one, dst, ldo);
          else if (mb == 2)
            dot_block<X, W, 2, 1>(xb, ldx, wn, w_stride_n, K, one, dst, ldo);
          else
            dot_block<X, W, 1, 1>(xb, ldx, wn, w_stride_n, K, one, dst, ldo);
          for (int m = 0; m < mb; ++m) acc[m][n] = one[m][0];
        }
      }
      for (int m = 0; m < mb; ++m)
        for (int n = 0; n < nb; ++n) store(out, (r + m) * ldo + n0 + n, acc[m][n]);
    }
  };
  // Each thread owns one contiguous run of tasks of about equal cost (rows + streaming the
  // weight block), so it streams one contiguous stretch of the weights and the hardware
  // prefetchers keep up: tasks handed out 4 at a time made the threads interleave and read at
  // ~35 of the machine's ~87 GB/s in decode (the experts of 8 layers, 2 threads: 5.5 -> 3.4 ms per
  // step of 8 layers at 2 rows per expert). A thread done with its run (the other was preempted,
  // or the costs misjudged) takes tasks from the other runs, claimed one by one.
  const int nth = num_threads() > 0 ? num_threads() : 1;
  int64_t* bounds = new int64_t[nth + 1];
  Cursor* cursor = new Cursor[nth];
  {
    const auto cost = [&](int64_t task) {
      const int s = busy[task / blocks_per_slot];
      return offsets[s + 1] - offsets[s] + TASK_COST_ROWS;
    };
    int64_t total = 0;
    for (int64_t task = 0; task < num_tasks; ++task) total += cost(task);
    int64_t acc = 0;
    int t = 1;
    bounds[0] = 0;
    for (int64_t task = 0; task < num_tasks && t < nth; ++task) {
      acc += cost(task);
      while (t < nth && acc * nth >= total * t) bounds[t++] = task + 1;
    }
    for (; t <= nth; ++t) bounds[t] = num_tasks;
    for (int i = 0; i < nth; ++i) cursor[i].next.store(bounds[i], std::memory_order_relaxed);
  }
#pragma omp parallel num_threads(nth)
  {
    const int me = omp_get_thread_num();
    for (int k = 0; k < nth; ++k) {  // its own run first, then the others' (also those of absent threads)
      const int run = (me + k) % nth;
      for (;;) {
        const int64_t task = cursor[run].next.fetch_add(1, std::memory_order_relaxed);
        if (task >= bounds[run + 1]) break;
        run_task(task);
      }
    }
  }
  delete[] cursor;
  delete[] bounds;
  delete[] busy;
}

}  // namespace

extern "C" {

void emoe_set_num_threads(int n) { emoe::g_num_threads = n; }

// Returns 0, or -1 for an unsupported dtype pair. dtypes: 0 = float32, 1 = bfloat16; out has x's dtype.
// slot_rows: nullptr (slot s reads w[s]) or [num_slots] weight rows.
int emoe_grouped_gemm(const void* x, int64_t ldx, int x_dtype, const int64_t* offsets, const int64_t* slot_rows,
                      int num_slots, const void* w, int64_t w_stride_e, int64_t w_stride_n, int w_dtype, void* out,
                      int64_t ldo, int64_t n_out, int64_t K) {
  if (x_dtype == kF32 && w_dtype == kF32) {
    grouped_gemm(static_cast<const float*>(x), ldx, offsets, slot_rows, num_slots, static_cast<const float*>(w), w_stride_e,
                 w_stride_n, static_cast<float*>(out), ldo, n_out, K);
  } else if (x_dtype == kF32 && w_dtype == kBF16) {
    grouped_gemm(static_cast<const float*>(x), ldx, offsets, slot_rows, num_slots, static_cast<const uint16_t*>(w), w_stride_e,
                 w_stride_n, static_cast<float*>(out), ldo, n_out, K);
  } else if (x_dtype == kBF16 && w_dtype == kBF16) {
    grouped_gemm(static_cast<const uint16_t*>(x), ldx, offsets, slot_rows, num_slots, static_cast<const uint16_t*>(w),
                 w_stride_e, w_stride_n, static_cast<uint16_t*>(out), ldo, n_out, K);
  } else {
    return -1;
  }
  return 0;
}

}  // extern "C"
