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
// along K (dot_kernel.h). Calls with many rows per slot (prefill) run on packed fp32 panels instead
// (packed_panel.h), bf16 ones on AVX-512 with bf16 dot products on panels of bf16 pairs
// (pair_panel.h); on AMX, bf16 weights run on tiles (amx_gemm.h).
//
// grouped_expand is the same product with the weights stored transposed ([E, K, Nout]), for a short
// K: LoRA's second projection, K = the adapter's rank.
//
// Built once per ISA (the Python side picks the build from elasticmoe.utils.cpu_features):
//   -DEMOE_AVX512 [-DEMOE_BF16DOT]   or   -DEMOE_AVX2
// Threads: OpenMP, i.e. PyTorch's own runtime (torch is loaded first; same libgomp soname).

#include <omp.h>

#include <cmath>
#include <cstdlib>
#include <type_traits>
#include <utility>
#include <vector>

#include "aligned_buffer.h"
#include "dot_kernel.h"
#include "packed_panel.h"
#include "pair_panel.h"
#include "task_runs.h"
#include "vec.h"
#if defined(EMOE_AMX)
#include "amx_gemm.h"
#endif

namespace {

using namespace emoe;
using namespace emoe::dot;

constexpr int TASK_COST_ROWS = 4;  // a task's cost beyond its rows, for balancing: streaming its weight block

// The row of w holding slot `slot`'s weights (slot_rows: a map, or null for the identity).
inline int64_t weight_row(const int64_t* slot_rows, int slot) { return slot_rows != nullptr ? slot_rows[slot] : slot; }

// The slots with rows, in order.
inline std::vector<int> busy_slots(const int64_t* offsets, int num_slots) {
  std::vector<int> busy;
  for (int s = 0; s < num_slots; ++s)
    if (offsets[s + 1] > offsets[s]) busy.push_back(s);
  return busy;
}

// Task t is the (t % tasks_per_slot)-th of busy slot t / tasks_per_slot; its balancing cost is its
// slot's rows plus `stream_cost` (reading its weights). Shared among `nth` threads.
inline TaskRuns slot_task_runs(const int64_t* offsets, const std::vector<int>& busy, int64_t tasks_per_slot,
                               int64_t stream_cost, int nth) {
  return TaskRuns(static_cast<int64_t>(busy.size()) * tasks_per_slot, nth, [&](int64_t t) {
    const int s = busy[t / tasks_per_slot];
    return offsets[s + 1] - offsets[s] + stream_cost;
  });
}

// task(slot, j) for each busy slot and j < tasks_per_slot, on the kernel's threads.
template <typename Task>
void for_slot_tasks(const int64_t* offsets, const std::vector<int>& busy, int64_t tasks_per_slot, int64_t stream_cost,
                    Task task) {
  const int nth = num_threads() > 0 ? num_threads() : 1;
  TaskRuns runs = slot_task_runs(offsets, busy, tasks_per_slot, stream_cost, nth);
#pragma omp parallel num_threads(nth)
  runs.work(omp_get_thread_num(), [&](int64_t t) { task(busy[t / tasks_per_slot], t % tasks_per_slot); });
}

// out[r, :] = sum_k x[r, k] * wt[slot(r)][k, :], rows grouped by slot as in grouped_gemm, with the
// weights stored transposed: wt [S, K, n_out], n_out contiguous. For a short K (LoRA's second
// projection, K = the adapter's rank) an output row is then K vector FMAs over its columns, k in
// order. The checkpoint layout's dot kernel reduces every output horizontally over K instead, which
// at such K costs more than the products: 64 groups of 4 rows, K = 8, 512 outputs, bf16, 2 threads
// (Zen 5): 373 us there, 139 us at K = 16; a gathered batched matmul 125 us.
constexpr int EXPAND_NB = 256;  // output columns per task, or fewer when that leaves threads idle:
constexpr int EXPAND_MIN_NB = 64;  // a call of one or two large groups (a prefill of one adapter)
constexpr int EXPAND_VECS = 4;  // vectors of columns per block: one broadcast of x[r, k] feeds them all

// Rows [r, r + R) of x (R = 1 or 2) times wt's [K, nb] block (leading dimension ldk) into the
// output rows outs[0..R): the columns in blocks of EXPAND_VECS vectors (each weight vector loaded
// once for both rows), then single vectors, then single columns; every output sums its K products
// in k order. Add: each sum, rounded to X, is added to what the row holds (as PyTorch's `y + d` of
// two X tensors: in fp32, rounded once), instead of stored.
template <int R, bool Add, typename X, typename W>
inline void expand_rows(const X* x, int64_t ldx, const W* ws, int64_t ldk, int nb, int64_t K, X* const* outs) {
  const auto put = [&](int i, int c, vec acc) {
    if constexpr (Add) acc = vadd(vload(outs[i] + c), round_vec(outs[i], acc));
    vstore_as(outs[i] + c, acc);  // rounds once more to X: the sum's rounding
  };
  int c = 0;
  for (; c + EXPAND_VECS * L <= nb; c += EXPAND_VECS * L) {
    vec acc[R][EXPAND_VECS];
    for (int i = 0; i < R; ++i)
      for (int v = 0; v < EXPAND_VECS; ++v) acc[i][v] = vzero();
    for (int64_t k = 0; k < K; ++k) {
      vec wk[EXPAND_VECS];
      for (int v = 0; v < EXPAND_VECS; ++v) wk[v] = vload(ws + k * ldk + c + v * L);
      for (int i = 0; i < R; ++i) {
        const vec xk = vset(scalar(x + i * ldx, k));
        for (int v = 0; v < EXPAND_VECS; ++v) acc[i][v] = vfma(xk, wk[v], acc[i][v]);
      }
    }
    for (int i = 0; i < R; ++i)
      for (int v = 0; v < EXPAND_VECS; ++v) put(i, c + v * L, acc[i][v]);
  }
  for (; c + L <= nb; c += L)
    for (int i = 0; i < R; ++i) {
      vec acc = vzero();
      for (int64_t k = 0; k < K; ++k) acc = vfma(vset(scalar(x + i * ldx, k)), vload(ws + k * ldk + c), acc);
      put(i, c, acc);
    }
  for (; c < nb; ++c)
    for (int i = 0; i < R; ++i) {
      float acc = 0.0f;
      for (int64_t k = 0; k < K; ++k) acc = std::fma(scalar(x + i * ldx, k), scalar(ws + k * ldk, c), acc);
      if constexpr (Add) acc = scalar(outs[i], c) + round_as(outs[i], acc);
      store(outs[i], c, acc);
    }
}

// Output columns per expand task for `busy` slots: EXPAND_NB, or EXPAND_MIN_NB when that would
// leave threads without tasks.
inline int64_t expand_cols(const std::vector<int>& busy, int64_t n_out, int nth) {
  return static_cast<int64_t>(busy.size()) * ((n_out + EXPAND_NB - 1) / EXPAND_NB) >= 4 * nth ? EXPAND_NB
                                                                                             : EXPAND_MIN_NB;
}

// Expand task (slot, j): the slot's rows of x times its wt block of columns [j * cols, ...),
// stored (Add false) or added (Add true) into out's row `rows[p]` for x's row p (rows null: p).
template <bool Add, typename X, typename W>
inline void expand_task(const X* x, int64_t ldx, const int64_t* offsets, const int64_t* rows, const W* ws,
                        int64_t ldk, int64_t cols, int64_t j, int64_t n_out, int64_t K, X* out, int64_t ldo,
                        int slot) {
  const int64_t n0 = j * cols;
  const int nb = static_cast<int>(n_out - n0 < cols ? n_out - n0 : cols);
  const auto row_out = [&](int64_t p) { return out + (rows != nullptr ? rows[p] : p) * ldo + n0; };
  int64_t p = offsets[slot];
  for (; p + 2 <= offsets[slot + 1]; p += 2) {
    X* const outs[2] = {row_out(p), row_out(p + 1)};
    expand_rows<2, Add>(x + p * ldx, ldx, ws + n0, ldk, nb, K, outs);
  }
  if (p < offsets[slot + 1]) {
    X* const outs[1] = {row_out(p)};
    expand_rows<1, Add>(x + p * ldx, ldx, ws + n0, ldk, nb, K, outs);
  }
}

template <typename X, typename W>
void grouped_expand(const X* x, int64_t ldx, const int64_t* offsets, const int64_t* slot_rows, int num_slots,
                    const W* wt, int64_t wt_stride_e, int64_t wt_stride_k, X* out, int64_t ldo, int64_t n_out,
                    int64_t K) {
  const std::vector<int> busy = busy_slots(offsets, num_slots);
  const int64_t cols = expand_cols(busy, n_out, num_threads() > 0 ? num_threads() : 1);
  for_slot_tasks(offsets, busy, (n_out + cols - 1) / cols, TASK_COST_ROWS, [&](int slot, int64_t j) {
    expand_task<false>(x, ldx, offsets, nullptr, wt + weight_row(slot_rows, slot) * wt_stride_e, wt_stride_k, cols, j,
                       n_out, K, out, ldo, slot);
  });
}

// Rows per busy slot, on average, from which a call runs on packed panels (packed_panel.h) instead
// of the dot kernel. AVX2, Zen 3, 2 threads, 32 experts of 512 x 512, GFLOP/s dot vs panel: 12 rows
// 122 / 99, 24 rows 125 / 124, 32 rows 120 / 129, 64 rows 120 / 151, 256 rows 123 / 173. AVX-512,
// Zen 5, fp32 activations, 32 experts, gate/up (K = 512) and down (K = 256), two runs each: fp32
// weights 16 rows 226-238 / 163-185 and 255-261 / 232-242, 32 rows 230-263 / 261-264 and 202-245 /
// 288-305, 256 rows 318-333 / 423-432 and 290-293 / 412-424; bf16 weights 32 rows 361-383 / 324-350
// and 335-345 / 404-406, 256 rows 383-390 / 442-449 and 342-343 / 431-432; one group of 2048 x 512 x
// 512: 295-319 / 472-482 (oneDNN: 470-480).
constexpr int64_t PANEL_MIN_ROWS = 32;
thread_local AlignedBuffer<float> g_panel;  // a task's packed weight panel

inline bool uses_panels(const int64_t* offsets, int num_slots, const std::vector<int>& busy) {
  return offsets[num_slots] - offsets[0] >= PANEL_MIN_ROWS * static_cast<int64_t>(busy.size());
}

// Rows [r0, r1) of x times `ncols` (<= panel::NR) weight rows from w, on a packed panel, or on the
// dot kernel when there is no memory for one.
template <typename X, typename W>
void panel_cols(const X* x, int64_t ldx, int64_t r0, int64_t r1, const W* w, int64_t ldw, int ncols, int64_t avail,
                int64_t K, X* out, int64_t ldo) {
  float* bp = g_panel.get(static_cast<size_t>(K) * panel::NR);
  if (bp == nullptr) {
    dot_cols(x, ldx, r0, r1, w, ldw, ncols, avail, K, out, ldo);
    return;
  }
  panel::pack(w, ldw, ncols, K, bp);
  panel::rows(x, ldx, r0, r1, bp, ncols, K, out, ldo);
}

// The grouped GEMM on packed panels (calls with many rows per slot, `uses_panels`): a task packs 16
// weight rows of a busy slot and runs all the slot's rows against them.
template <typename X, typename W>
void panel_grouped_gemm(const X* x, int64_t ldx, const int64_t* offsets, const std::vector<int>& busy,
                        const int64_t* slot_rows, const W* w, int64_t w_stride_e, int64_t w_stride_n, X* out,
                        int64_t ldo, int64_t n_out, int64_t K) {
  for_slot_tasks(offsets, busy, (n_out + panel::NR - 1) / panel::NR, 2 * TASK_COST_ROWS, [&](int slot, int64_t j) {
    const int64_t n0 = j * panel::NR;
    const int64_t row = weight_row(slot_rows, slot);
    panel_cols(x, ldx, offsets[slot], offsets[slot + 1], w + row * w_stride_e + n0 * w_stride_n, w_stride_n,
               static_cast<int>(n_out - n0 < panel::NR ? n_out - n0 : panel::NR), n_out - n0, K, out + n0, ldo);
  });
}

#if defined(EMOE_AVX2)
// silu(g) * u for 8 values, as PyTorch's F.silu(g) * u: g * sigmoid(g), sigmoid from exp(-|g|).
inline __m256 silu_mul(__m256 g, __m256 u) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 e = vexp_nonpos(_mm256_or_ps(g, _mm256_set1_ps(-0.0f)));  // exp(-|g|)
  const __m256 sig = _mm256_div_ps(_mm256_blendv_ps(one, e, g), _mm256_add_ps(one, e));  // g < 0: e / (1 + e)
  return _mm256_mul_ps(_mm256_mul_ps(g, sig), u);
}
#endif

inline float silu_mul(float g, float u) { return g / (1.0f + expf(-g)) * u; }

// o[0:n] = silu(g[0:n]) * u[0:n].
inline void silu_mul_row(const float* g, const float* u, float* o, int n) {
#if defined(EMOE_AVX512)
  for (int c = 0; c < n; c += 16) {  // masked: a decode task's rows are 8 values wide
    const __mmask16 m = n - c >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (n - c)) - 1);
    const __m512 h = _mm512_mul_ps(silu(_mm512_maskz_loadu_ps(m, g + c)), _mm512_maskz_loadu_ps(m, u + c));
    _mm512_mask_storeu_ps(o + c, m, h);
  }
#else
  int c = 0;
  for (; c + 8 <= n; c += 8) _mm256_storeu_ps(o + c, silu_mul(_mm256_loadu_ps(g + c), _mm256_loadu_ps(u + c)));
  for (; c < n; ++c) o[c] = silu_mul(g[c], u[c]);
#endif
}

// A fused SwiGLU's decode-size task on the dot kernel: a block of nb (<= NB) gate columns and the
// same block of up columns for rows [0, rows) of x, into gate and up (row stride ldo). `next` is
// the next task's gate block (or null). Blocks are read gate, up, next gate, next up, and each
// prefetches the one read PREFETCH_AHEAD blocks later (dot_kernel.h).
template <typename X, typename W>
inline void dot_gate_up(const X* x, int64_t ldx, int64_t rows, const W* gate_w, const W* up_w, const W* next,
                        int64_t ldw, int nb, int64_t K, X* gate, X* up, int64_t ldo) {
  const W* next_up = next != nullptr ? up_w + (next - gate_w) : nullptr;
  dot_rows(x, ldx, 0, rows, gate_w, ldw, nb, K, gate, ldo, PREFETCH_AHEAD == 1 ? up_w : next);
  dot_rows(x, ldx, 0, rows, up_w, ldw, nb, K, up, ldo, PREFETCH_AHEAD == 1 ? next : next_up);
}

// The tasks of a fused SwiGLU over w [E, 2 * inter, K] (each slot's gate rows, then its up rows):
// task(r0, rows, j0, nb, gate_w, up_w, next) for each busy slot (its rows [r0, r0 + rows)) and each
// block of `unit` gate columns from j0 (nb of them; the last block may be partial), gate_w and up_w
// pointing at the block's gate and up rows, `next` at the next block's gate rows (null for the last).
template <typename W, typename Task>
void for_gate_up_tasks(const int64_t* offsets, const std::vector<int>& busy, const int64_t* slot_rows, const W* w,
                       int64_t w_stride_e, int64_t w_stride_n, int64_t inter, int unit, Task task) {
  for_slot_tasks(offsets, busy, (inter + unit - 1) / unit, 2 * TASK_COST_ROWS * unit / NB, [&](int slot, int64_t j) {
    const int64_t j0 = j * unit;
    const W* gate_w = w + weight_row(slot_rows, slot) * w_stride_e + j0 * w_stride_n;
    task(offsets[slot], offsets[slot + 1] - offsets[slot], j0, static_cast<int>(inter - j0 < unit ? inter - j0 : unit),
         gate_w, gate_w + inter * w_stride_n, j0 + unit < inter ? gate_w + unit * w_stride_n : nullptr);
  });
}

thread_local std::vector<float> g_gate_up;  // a task's gate and up results, before the activation

// silu(x @ gate^T) * (x @ up^T) per group, fp32 activations, w [E, 2 * inter, K] holding each slot's
// gate rows then its up rows: a task computes one block of gate columns and the same block of up
// columns for all the slot's rows (the dot kernel, or packed panels for many rows per slot, as the
// grouped GEMM chooses) and writes only their product: no [N, 2 * inter] intermediate, no
// separate activation passes.
template <typename W>
void fp32_grouped_swiglu(const float* x, int64_t ldx, const int64_t* offsets, const int64_t* slot_rows,
                         int num_slots, const W* w, int64_t w_stride_e, int64_t w_stride_n, float* out, int64_t ldo,
                         int64_t inter, int64_t K) {
  const std::vector<int> busy = busy_slots(offsets, num_slots);
  const bool panels = uses_panels(offsets, num_slots, busy);
  const int unit = panels ? panel::NR : NB;  // gate (and up) columns per task
  for_gate_up_tasks(offsets, busy, slot_rows, w, w_stride_e, w_stride_n, inter, unit,
                    [&](int64_t r0, int64_t rows, int64_t j0, int nb, const W* gate_w, const W* up_w, const W* next) {
    const float* xs = x + r0 * ldx;
    g_gate_up.resize(static_cast<size_t>(2 * rows * unit));
    float* gate = g_gate_up.data();
    float* up = gate + rows * unit;
    if (panels) {
      panel_cols(xs, ldx, 0, rows, gate_w, w_stride_n, nb, inter - j0, K, gate, unit);
      panel_cols(xs, ldx, 0, rows, up_w, w_stride_n, nb, inter - j0, K, up, unit);
    } else {
      dot_gate_up(xs, ldx, rows, gate_w, up_w, next, w_stride_n, nb, K, gate, up, unit);
    }
    for (int64_t r = 0; r < rows; ++r) silu_mul_row(gate + r * unit, up + r * unit, out + (r0 + r) * ldo + j0, nb);
  });
}

#if defined(EMOE_BF16DOT)
// A bf16 call runs on pair panels (pair_panel.h) instead of the dot kernel from max(16, K / 32)
// rows per busy slot, on average: packing costs per weight value, the dot kernel's reductions per
// output. Zen 5, 2 threads, 32 experts, weights in cache, GFLOP/s dot vs panel: K = 512 (gate and
// up, 512 outputs) 8 rows 251-381 / 407-416, 16 rows 502-526 / 479-484, 64 rows 536-565 / 675-707;
// K = 256 (down, 512 outputs) 8 rows 220-294 / 437-470, 16 rows 418-427 / 517-569, 256 rows
// 331-423 / 829-843. Decode-size groups (64 sequences: 8 rows per expert) stay on the dot kernel,
// which prefetches the next weight block from DRAM: with the down projection on panels too, the
// engine's TPOT read 19.4-21.3 ms against 18.6-18.7 (runs in turn; with 16 rows: 17.0-20.3 against
// 19.0-20.4).
constexpr int64_t PAIR_PANEL_MIN_ROWS = 16;
constexpr int64_t PAIR_PANEL_K_PER_ROW = 32;
thread_local AlignedBuffer<uint32_t> g_pair_panel;  // a task's packed weight panel

inline bool uses_pair_panels(const int64_t* offsets, int num_slots, const std::vector<int>& busy, int64_t K) {
  const int64_t min_rows = K / PAIR_PANEL_K_PER_ROW > PAIR_PANEL_MIN_ROWS ? K / PAIR_PANEL_K_PER_ROW : PAIR_PANEL_MIN_ROWS;
  return !busy.empty() && offsets[num_slots] - offsets[0] >= min_rows * static_cast<int64_t>(busy.size());
}

// Rows [r0, r1) of x against the weight rows half[0] + i * ldw (i < nb[0]) and half[1] + i * ldw
// (i < nb[1]) packed into one pair panel, stored by `Out`; false (nothing done) without memory
// for the panel.
template <typename Out>
bool pair_panel_rows(const uint16_t* x, int64_t ldx, int64_t r0, int64_t r1, const uint16_t* const half[2],
                     const int nb[2], int64_t ldw, int64_t K, uint16_t* out, int64_t ldo, int out_cols) {
  uint32_t* bp = g_pair_panel.get(static_cast<size_t>(pair_panel::panel_dwords(K)));
  if (bp == nullptr) return false;
  pair_panel::pack(half, nb, ldw, K, bp);
  pair_panel::rows<Out>(x, ldx, r0, r1, bp, out_cols, K, out, ldo);
  return true;
}

// The grouped GEMM on pair panels (bf16 calls with many rows per slot): a task packs 32 weight
// rows of a busy slot and runs all the slot's rows against them.
void pair_panel_grouped_gemm(const uint16_t* x, int64_t ldx, const int64_t* offsets, const std::vector<int>& busy,
                             const int64_t* slot_rows, const uint16_t* w, int64_t w_stride_e, int64_t w_stride_n,
                             uint16_t* out, int64_t ldo, int64_t n_out, int64_t K) {
  constexpr int NR = pair_panel::NR;
  for_slot_tasks(offsets, busy, (n_out + NR - 1) / NR, TASK_COST_ROWS * NR / NB, [&](int slot, int64_t j) {
    const int64_t n0 = j * NR;
    const int nb = static_cast<int>(n_out - n0 < NR ? n_out - n0 : NR);
    const uint16_t* ws = w + weight_row(slot_rows, slot) * w_stride_e + n0 * w_stride_n;
    const uint16_t* half[2] = {ws, ws + 16 * w_stride_n};  // the second is never read when nb <= 16
    const int nbh[2] = {nb < 16 ? nb : 16, nb > 16 ? nb - 16 : 0};
    if (!pair_panel_rows<pair_panel::Plain>(x, ldx, offsets[slot], offsets[slot + 1], half, nbh, w_stride_n, K,
                                            out + n0, ldo, nb))
      dot_cols(x, ldx, offsets[slot], offsets[slot + 1], ws, w_stride_n, nb, n_out - n0, K, out + n0, ldo);
  });
}

thread_local std::vector<uint16_t> g_gate_up_bf16;  // a dot task's gate and up results, before the activation

// silu(x @ gate^T) * (x @ up^T) per group, bf16 activations and weights, w [E, 2 * inter, K]
// holding each slot's gate rows then its up rows, rounded where PyTorch's bf16 path rounds (the
// two projections, silu, the product). Many rows per slot: a task packs 16 gate rows and the same
// 16 up rows into one pair panel and stores only the product. Few (decode): the dot kernel
// computes a block of gate and up columns for the slot's rows, then the activation.
void bf16_grouped_swiglu(const uint16_t* x, int64_t ldx, const int64_t* offsets, const int64_t* slot_rows,
                         int num_slots, const uint16_t* w, int64_t w_stride_e, int64_t w_stride_n, uint16_t* out,
                         int64_t ldo, int64_t inter, int64_t K) {
  const std::vector<int> busy = busy_slots(offsets, num_slots);
  const bool panels = uses_pair_panels(offsets, num_slots, busy, K);
  const int unit = panels ? 16 : NB;  // gate (and up) columns per task
  for_gate_up_tasks(offsets, busy, slot_rows, w, w_stride_e, w_stride_n, inter, unit,
                    [&](int64_t r0, int64_t rows, int64_t j0, int nb, const uint16_t* gate_w, const uint16_t* up_w,
                        const uint16_t* next) {
    if (panels) {
      const uint16_t* half[2] = {gate_w, up_w};
      const int nbh[2] = {nb, nb};
      if (pair_panel_rows<pair_panel::SwiGLU>(x, ldx, r0, r0 + rows, half, nbh, w_stride_n, K, out + j0, ldo, nb))
        return;
    }
    g_gate_up_bf16.resize(static_cast<size_t>(2 * rows * nb));
    uint16_t* gate = g_gate_up_bf16.data();
    uint16_t* up = gate + rows * nb;
    const uint16_t* xs = x + r0 * ldx;
    dot_gate_up(xs, ldx, rows, gate_w, up_w, next, w_stride_n, nb, K, gate, up, nb);
    const __mmask16 mask = static_cast<__mmask16>((1u << nb) - 1);
    for (int64_t r = 0; r < rows; ++r) {  // gate and up are already rounded to bf16: as PyTorch's silu and mul see them
      const __m512 g = widen(_mm256_maskz_loadu_epi16(mask, gate + r * nb));
      const __m512 u = widen(_mm256_maskz_loadu_epi16(mask, up + r * nb));
      const __m512 h = _mm512_mul_ps(vround_bf16(silu(g)), u);
      const __m256i bits = _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_rounded_bits(h), 16));
      _mm256_mask_storeu_epi16(out + (r0 + r) * ldo + j0, mask, bits);
    }
  });
}
#endif

// Whether grouped_gemm computes a call on its dot tasks (`dot_task`): not on bf16 pair panels,
// not on packed panels. The fused LoRA kernel asks it to keep grouped_gemm's sums.
template <typename X, typename W>
inline bool uses_dot_tasks(const int64_t* offsets, int num_slots, const std::vector<int>& busy, int64_t K) {
#if defined(EMOE_BF16DOT)
  if constexpr (std::is_same_v<X, uint16_t> && std::is_same_v<W, uint16_t>) {
    if (uses_pair_panels(offsets, num_slots, busy, K)) return false;
  }
#endif
  return busy.empty() || !uses_panels(offsets, num_slots, busy);
}

// Dot task (slot, j): the slot's rows of x times weight rows [j * NB, ...) of ws (the slot's
// weights, row stride w_stride_n) into out's columns from j * NB.
template <typename X, typename W>
inline void dot_task(const X* x, int64_t ldx, const int64_t* offsets, int slot, const W* ws, int64_t w_stride_n,
                     int64_t j, int64_t n_out, int64_t K, X* out, int64_t ldo) {
  const int64_t n0 = j * NB;
  dot_cols(x, ldx, offsets[slot], offsets[slot + 1], ws + n0 * w_stride_n, w_stride_n, n_out - n0 < NB ? n_out - n0 : NB,
           n_out - n0, K, out + n0, ldo);
}

template <typename X, typename W>
void grouped_gemm(const X* x, int64_t ldx, const int64_t* offsets, const int64_t* slot_rows, int num_slots,
                  const W* w, int64_t w_stride_e, int64_t w_stride_n, X* out, int64_t ldo, int64_t n_out, int64_t K) {
  const std::vector<int> busy = busy_slots(offsets, num_slots);
  if (!uses_dot_tasks<X, W>(offsets, num_slots, busy, K)) {
#if defined(EMOE_BF16DOT)
    if constexpr (std::is_same_v<X, uint16_t> && std::is_same_v<W, uint16_t>) {
      if (uses_pair_panels(offsets, num_slots, busy, K)) {
        pair_panel_grouped_gemm(x, ldx, offsets, busy, slot_rows, w, w_stride_e, w_stride_n, out, ldo, n_out, K);
        return;
      }
    }
#endif
    panel_grouped_gemm(x, ldx, offsets, busy, slot_rows, w, w_stride_e, w_stride_n, out, ldo, n_out, K);
    return;
  }
  // Tasks: (slot, block of NB weight rows), only for slots with rows.
  for_slot_tasks(offsets, busy, (n_out + NB - 1) / NB, TASK_COST_ROWS, [&](int slot, int64_t j) {
    dot_task(x, ldx, offsets, slot, w + weight_row(slot_rows, slot) * w_stride_e, w_stride_n, j, n_out, K, out, ldo);
  });
}

#if defined(EMOE_AMX)
bool g_amx = false;  // set by emoe_amx_init: the process may use AMX tiles

// The packed activations, per thread (a prefill step packs several MB per projection).
thread_local AlignedBuffer<uint16_t> g_scratch;

// The activations of a call's groups packed into AMX B tiles (amx_gemm.h), then `tasks_per_slot`
// tasks per slot with rows: task(i, slot, j, packed) for the i-th busy slot, j < tasks_per_slot.
// Returns false (nothing done) without scratch memory.
template <typename X, typename Task>
bool amx_run(const X* x, int64_t ldx, const int64_t* offsets, int num_slots, int64_t K, int64_t tasks_per_slot,
             int64_t task_cost, Task task) {
  using namespace amx;
  const int parts = sizeof(X) == 4 ? MAX_PARTS : 1;
  const int64_t block_elems = (K + TILE_K - 1) / TILE_K * parts * TILE_ELEMS;  // one token block, packed
  const std::vector<int> busy = busy_slots(offsets, num_slots);
  std::vector<int64_t> first_block(busy.size() + 1, 0);  // each busy slot's first packed token block
  for (size_t i = 0; i < busy.size(); ++i)
    first_block[i + 1] = first_block[i] + (offsets[busy[i] + 1] - offsets[busy[i]] + 15) / 16;
  const int64_t num_blocks = first_block.back();
  uint16_t* xp = g_scratch.get(static_cast<size_t>(num_blocks * block_elems));
  if (xp == nullptr) return false;
  std::vector<std::pair<int64_t, int>> block_rows(num_blocks);  // (first row, rows) of each token block
  for (size_t i = 0; i < busy.size(); ++i)
    for (int64_t b = first_block[i]; b < first_block[i + 1]; ++b) {
      const int64_t r = offsets[busy[i]] + (b - first_block[i]) * 16;
      block_rows[b] = {r, static_cast<int>(offsets[busy[i] + 1] - r < 16 ? offsets[busy[i] + 1] - r : 16)};
    }
  const int nth = num_threads() > 0 ? num_threads() : 1;
  TaskRuns runs = slot_task_runs(offsets, busy, tasks_per_slot, task_cost, nth);
#pragma omp parallel num_threads(nth)
  {
#pragma omp for schedule(static)
    for (int64_t b = 0; b < num_blocks; ++b)
      pack_token_block(x + block_rows[b].first * ldx, ldx, block_rows[b].second, K, parts, xp + b * block_elems);
    configure_tiles();
    runs.work(omp_get_thread_num(), [&](int64_t t) {
      const int64_t i = t / tasks_per_slot;
      task(busy[i], t % tasks_per_slot, xp + first_block[i] * block_elems, parts);
    });
    _tile_release();
  }
  return true;
}

// Weight rows per task: two A tiles. A task streams its 32 weight rows once for all the slot's
// rows; TASK_COST_ROWS per NB rows is the balancing cost of that stream.
constexpr int AMX_NB = 32;
constexpr int64_t AMX_TASK_COST = TASK_COST_ROWS * AMX_NB / NB;

// The grouped GEMM on AMX tiles; bf16 weights only. Weight rows past the last full 16
// (n_out % 16) run on the dot kernel.
template <typename X>
bool amx_grouped_gemm(const X* x, int64_t ldx, const int64_t* offsets, const int64_t* slot_rows, int num_slots,
                      const uint16_t* w, int64_t w_stride_e, int64_t w_stride_n, X* out, int64_t ldo, int64_t n_out,
                      int64_t K) {
  const int64_t n16 = n_out / 16 * 16;
  const int64_t tasks_per_slot = (n16 + AMX_NB - 1) / AMX_NB + (n_out > n16);
  return amx_run(x, ldx, offsets, num_slots, K, tasks_per_slot, AMX_TASK_COST,
                 [&](int slot, int64_t j, const uint16_t* packed, int parts) {
    const int64_t row = weight_row(slot_rows, slot);
    const uint16_t* ws = w + row * w_stride_e;
    const int64_t r0 = offsets[slot], rows = offsets[slot + 1] - r0;
    const int64_t n0 = j * AMX_NB;
    if (n0 >= n16) {  // the last rows, fewer than 16
      dot_rows(x, ldx, r0, r0 + rows, ws + n16 * w_stride_n, w_stride_n, static_cast<int>(n_out - n16), K, out + n16,
               ldo, static_cast<const uint16_t*>(nullptr));
    } else if (n16 - n0 >= AMX_NB) {
      const uint16_t* pf = n0 + 2 * AMX_NB <= n16 ? ws + (n0 + AMX_NB) * w_stride_n : nullptr;
      amx::run_rows<amx::Plain, X, 2>(ws + n0 * w_stride_n, w_stride_n, 16 * w_stride_n, K, packed, rows, parts,
                                      out + r0 * ldo + n0, ldo, pf);
    } else {
      amx::run_rows<amx::Plain, X, 1>(ws + n0 * w_stride_n, w_stride_n, 0, K, packed, rows, parts,
                                      out + r0 * ldo + n0, ldo);
    }
  });
}

// silu(x @ gate^T) * (x @ up^T) with w [E, 2 * inter, K] holding each slot's gate rows then its up
// rows: the expert MLP's first projection and its activation in one pass (inter % 16 == 0).
template <typename X>
bool amx_grouped_swiglu(const X* x, int64_t ldx, const int64_t* offsets, const int64_t* slot_rows, int num_slots,
                        const uint16_t* w, int64_t w_stride_e, int64_t w_stride_n, X* out, int64_t ldo, int64_t inter,
                        int64_t K) {
  return amx_run(x, ldx, offsets, num_slots, K, inter / 16, AMX_TASK_COST,
                 [&](int slot, int64_t j, const uint16_t* packed, int parts) {
    const int64_t row = weight_row(slot_rows, slot);
    const int64_t r0 = offsets[slot], rows = offsets[slot + 1] - r0;
    const uint16_t* ws = w + row * w_stride_e + j * 16 * w_stride_n;
    amx::run_rows<amx::SwiGLU, X, 2>(ws, w_stride_n, inter * w_stride_n, K, packed, rows, parts, out + r0 * ldo + j * 16,
                                     ldo, (j + 1) * 16 < inter ? ws + 16 * w_stride_n : nullptr);
  });
}
#endif

// A LoRA site's whole product, added into its rows' outputs, in one parallel region:
//
//   out[rows[p], :] += round_X(round_X(x[p, :] @ a[slot(p)]^T) @ bt[slot(p)])   for each pair p
//
// x: the pairs' inputs in pair order (grouped by slot as in grouped_gemm), rows: each pair's output
// row (null: p; no row twice), a [S, R, n_in], bt [S, R, n_out] (B transposed), h: scratch [P, R].
// Its two phases are grouped_gemm's dot tasks (h = x @ a^T, rounded to X as that kernel stores it)
// and grouped_expand's tasks, a barrier of the team between them: the sums of the two kernels and
// of PyTorch's add, without a second region, an output tensor, a scatter and an add (a decode's
// LoRA site of 16-64 adapters: 22-39 us, against 42-58 us as those separate calls; docs/adapters.md).
// Returns false, having done nothing, where grouped_gemm would compute h otherwise (packed panels,
// bf16 pair panels, AMX tiles): the caller runs the two kernels.
template <typename X, typename W>
bool grouped_lora_add(const X* x, int64_t ldx, const int64_t* rows, const int64_t* offsets, int num_slots,
                      const W* a, int64_t a_stride_e, int64_t a_stride_r, const W* bt, int64_t bt_stride_e,
                      int64_t bt_stride_k, X* out, int64_t ldo, int64_t n_in, int64_t n_out, int64_t rank, X* h) {
  const std::vector<int> busy = busy_slots(offsets, num_slots);
  if (busy.empty()) return true;
#if defined(EMOE_AMX)
  if (g_amx && std::is_same_v<W, uint16_t>) return false;
#endif
  if (!uses_dot_tasks<X, W>(offsets, num_slots, busy, n_in)) return false;
  const int nth = num_threads() > 0 ? num_threads() : 1;
  const int64_t cols = expand_cols(busy, n_out, nth);
  const int64_t shrink_tasks = (rank + NB - 1) / NB, expand_tasks = (n_out + cols - 1) / cols;
  TaskRuns shrink = slot_task_runs(offsets, busy, shrink_tasks, TASK_COST_ROWS, nth);
  TaskRuns expand = slot_task_runs(offsets, busy, expand_tasks, TASK_COST_ROWS, nth);
#pragma omp parallel num_threads(nth)
  {
    const int me = omp_get_thread_num();
    shrink.work(me, [&](int64_t t) {
      const int slot = busy[t / shrink_tasks];
      dot_task(x, ldx, offsets, slot, a + slot * a_stride_e, a_stride_r, t % shrink_tasks, rank, n_in, h, rank);
    });
#pragma omp barrier
    expand.work(me, [&](int64_t t) {
      const int slot = busy[t / expand_tasks];
      expand_task<true>(h, rank, offsets, rows, bt + slot * bt_stride_e, bt_stride_k, cols, t % expand_tasks, n_out,
                        rank, out, ldo, slot);
    });
  }
  return true;
}

}  // namespace

extern "C" {

void emoe_set_num_threads(int n) { emoe::g_num_threads = n; }

// Asks the OS for AMX's tile state and uses the AMX path for bf16 weights from then on.
// Returns 1 when granted, 0 when not (the dot kernel runs), -1 in a build without AMX.
int emoe_amx_init() {
#if defined(EMOE_AMX)
  g_amx = emoe::amx::request_permission();
  return g_amx ? 1 : 0;
#else
  return -1;
#endif
}

// Whether emoe_grouped_swiglu serves this dtype pair in this build (and process): AMX tiles for bf16
// weights, bf16 dot products for bf16 activations and weights, every build for fp32 activations.
int emoe_fuses_swiglu(int x_dtype, int w_dtype) {
#if defined(EMOE_AMX)
  if (g_amx && w_dtype == kBF16) return 1;
#endif
#if defined(EMOE_BF16DOT)
  if (x_dtype == kBF16 && w_dtype == kBF16) return 1;
#endif
  return x_dtype == kF32 && (w_dtype == kF32 || w_dtype == kBF16) ? 1 : 0;
}

// silu(x @ w[:, :inter]^T) * (x @ w[:, inter:]^T) per group (w: [E, 2 * inter, K]) into out
// [N, inter]. Returns 0, or -1 where not served (see emoe_fuses_swiglu; on AMX also inter % 16):
// the caller runs emoe_grouped_gemm and the activation itself.
int emoe_grouped_swiglu(const void* x, int64_t ldx, int x_dtype, const int64_t* offsets, const int64_t* slot_rows,
                        int num_slots, const void* w, int64_t w_stride_e, int64_t w_stride_n, int w_dtype, void* out,
                        int64_t ldo, int64_t inter, int64_t K) {
#if defined(EMOE_AMX)
  if (g_amx && w_dtype == kBF16 && inter % 16 == 0) {
    const auto run = [&](auto* typed_out) {
      using X = std::remove_pointer_t<decltype(typed_out)>;
      return amx_grouped_swiglu(static_cast<const X*>(x), ldx, offsets, slot_rows, num_slots,
                                static_cast<const uint16_t*>(w), w_stride_e, w_stride_n, typed_out, ldo, inter, K);
    };
    if (x_dtype == kF32 && run(static_cast<float*>(out))) return 0;
    if (x_dtype == kBF16 && run(static_cast<uint16_t*>(out))) return 0;
  }
#endif
#if defined(EMOE_BF16DOT)
  if (x_dtype == kBF16 && w_dtype == kBF16) {
    bf16_grouped_swiglu(static_cast<const uint16_t*>(x), ldx, offsets, slot_rows, num_slots,
                        static_cast<const uint16_t*>(w), w_stride_e, w_stride_n, static_cast<uint16_t*>(out), ldo, inter,
                        K);
    return 0;
  }
#endif
  if (x_dtype == kF32 && w_dtype == kF32) {
    fp32_grouped_swiglu(static_cast<const float*>(x), ldx, offsets, slot_rows, num_slots, static_cast<const float*>(w),
                        w_stride_e, w_stride_n, static_cast<float*>(out), ldo, inter, K);
    return 0;
  }
  if (x_dtype == kF32 && w_dtype == kBF16) {
    fp32_grouped_swiglu(static_cast<const float*>(x), ldx, offsets, slot_rows, num_slots,
                        static_cast<const uint16_t*>(w), w_stride_e, w_stride_n, static_cast<float*>(out), ldo, inter,
                        K);
    return 0;
  }
  return -1;
}

// Returns 0, or -1 for an unsupported dtype pair. dtypes: 0 = float32, 1 = bfloat16; out has x's dtype.
// slot_rows: nullptr (slot s reads w[s]) or [num_slots] weight rows.
int emoe_grouped_gemm(const void* x, int64_t ldx, int x_dtype, const int64_t* offsets, const int64_t* slot_rows,
                      int num_slots, const void* w, int64_t w_stride_e, int64_t w_stride_n, int w_dtype, void* out,
                      int64_t ldo, int64_t n_out, int64_t K) {
  // bf16 weights: on AMX tiles where the OS granted them, else the dot kernel.
  const auto bf16_weights = [&](auto* typed_out) {
    using X = std::remove_pointer_t<decltype(typed_out)>;
    const auto* xt = static_cast<const X*>(x);
    const auto* wb = static_cast<const uint16_t*>(w);
#if defined(EMOE_AMX)
    if (g_amx && amx_grouped_gemm(xt, ldx, offsets, slot_rows, num_slots, wb, w_stride_e, w_stride_n, typed_out, ldo,
                                  n_out, K))
      return;
#endif
    grouped_gemm(xt, ldx, offsets, slot_rows, num_slots, wb, w_stride_e, w_stride_n, typed_out, ldo, n_out, K);
  };
  if (x_dtype == kF32 && w_dtype == kF32) {
    grouped_gemm(static_cast<const float*>(x), ldx, offsets, slot_rows, num_slots, static_cast<const float*>(w), w_stride_e,
                 w_stride_n, static_cast<float*>(out), ldo, n_out, K);
  } else if (x_dtype == kF32 && w_dtype == kBF16) {
    bf16_weights(static_cast<float*>(out));
  } else if (x_dtype == kBF16 && w_dtype == kBF16) {
    bf16_weights(static_cast<uint16_t*>(out));
  } else {
    return -1;
  }
  return 0;
}

// grouped_expand (above): wt [S, K, n_out] with n_out contiguous. Returns 0, or -1 for an
// unsupported dtype pair (as emoe_grouped_gemm).
int emoe_grouped_expand(const void* x, int64_t ldx, int x_dtype, const int64_t* offsets, const int64_t* slot_rows,
                        int num_slots, const void* wt, int64_t wt_stride_e, int64_t wt_stride_k, int w_dtype,
                        void* out, int64_t ldo, int64_t n_out, int64_t K) {
  if (x_dtype == kF32 && w_dtype == kF32) {
    grouped_expand(static_cast<const float*>(x), ldx, offsets, slot_rows, num_slots, static_cast<const float*>(wt),
                   wt_stride_e, wt_stride_k, static_cast<float*>(out), ldo, n_out, K);
  } else if (x_dtype == kF32 && w_dtype == kBF16) {
    grouped_expand(static_cast<const float*>(x), ldx, offsets, slot_rows, num_slots, static_cast<const uint16_t*>(wt),
                   wt_stride_e, wt_stride_k, static_cast<float*>(out), ldo, n_out, K);
  } else if (x_dtype == kBF16 && w_dtype == kBF16) {
    grouped_expand(static_cast<const uint16_t*>(x), ldx, offsets, slot_rows, num_slots,
                   static_cast<const uint16_t*>(wt), wt_stride_e, wt_stride_k, static_cast<uint16_t*>(out), ldo, n_out,
                   K);
  } else {
    return -1;
  }
  return 0;
}

// grouped_lora_add (above): returns 0 done, 1 left to the caller's two kernels, -1 for an
// unsupported dtype pair (as emoe_grouped_gemm).
int emoe_grouped_lora_add(const void* x, int64_t ldx, int x_dtype, const int64_t* rows, const int64_t* offsets,
                          int num_slots, const void* a, int64_t a_stride_e, int64_t a_stride_r, const void* bt,
                          int64_t bt_stride_e, int64_t bt_stride_k, int w_dtype, void* out, int64_t ldo, int64_t n_in,
                          int64_t n_out, int64_t rank, void* h) {
  const auto run = [&](auto* typed_out, auto* typed_w) {
    using X = std::remove_pointer_t<decltype(typed_out)>;
    using W = std::remove_const_t<std::remove_pointer_t<decltype(typed_w)>>;
    return grouped_lora_add(static_cast<const X*>(x), ldx, rows, offsets, num_slots, static_cast<const W*>(a),
                            a_stride_e, a_stride_r, static_cast<const W*>(bt), bt_stride_e, bt_stride_k, typed_out,
                            ldo, n_in, n_out, rank, static_cast<X*>(h))
               ? 0
               : 1;
  };
  if (x_dtype == kF32 && w_dtype == kF32) return run(static_cast<float*>(out), static_cast<const float*>(nullptr));
  if (x_dtype == kF32 && w_dtype == kBF16) return run(static_cast<float*>(out), static_cast<const uint16_t*>(nullptr));
  if (x_dtype == kBF16 && w_dtype == kBF16)
    return run(static_cast<uint16_t*>(out), static_cast<const uint16_t*>(nullptr));
  return -1;
}

}  // extern "C"
