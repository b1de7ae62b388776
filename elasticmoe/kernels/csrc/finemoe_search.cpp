// FineMoE's work after each MoE layer's router (§4.2.2, §4.3), in one call: the trajectory
// search's running sums take the layer's gate distributions, the best stored map is found
// (eq. 5), and the layer d ahead is planned from its minimum expert set (eqs. 6-8). A second
// entry point plans a layer from matches found elsewhere: the semantic search's, for the
// iteration's first d layers (§4.2.1).
//
// A third entry point picks the eviction victims (§4.5) by the same guide; a fourth places an
// iteration's new records in a full Expert Map Store (§4.4); a fifth turns the semantic search's
// dot products into its scores and best matches (eq. 4).
//
// It runs on the forward thread after every MoE layer of every step. In NumPy it is ~25 small
// array operations (~90-130 us per layer on a few thousand numbers, nearly all of it dispatch);
// here it is one pass. The arithmetic follows the NumPy reference step by step in the same
// precision (`elasticmoe.offload.map_store.TrajectorySearch`, `selection.minimum_expert_sets`,
// `FineMoEPolicy._plan_layer`): dot products and scores in fp32, thresholds and cumulative sums
// in fp64, equal probabilities in expert-id order, equal scores to the most recent record.
// Only the fp32 sums' order differs from BLAS, so scores agree to fp32 rounding.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr float kEps = 1e-12f;  // a zero vector has cosine 0 with everything (as in map_store)
constexpr double kFloorTolerance = 1e-3;  // selection.FLOOR_TOLERANCE

// The record of the highest `score(c)` among `num_records`, equal scores to the highest insertion
// stamp (`map_store.latest_best`); its score to `score_out`.
template <typename Score>
int64_t latest_best(Score score, const int64_t* stamps, int64_t num_records, float* score_out) {
  int64_t best = 0;
  float best_score = -std::numeric_limits<float>::infinity();
  for (int64_t c = 0; c < num_records; ++c) {
    const float value = score(c);
    if (value > best_score || (value == best_score && stamps[c] > stamps[best])) {
      best = c;
      best_score = value;
    }
  }
  *score_out = best_score;
  return best;
}

// The stored record most similar to the trajectory with dot products `dots` [C] and squared
// norm `new_sq`; equal scores go to the highest insertion stamp.
int64_t best_record(const float* dots, float new_sq, const float* norms, const int64_t* stamps, int64_t num_records,
                    float* score_out) {
  const float new_norm = std::max(std::sqrt(new_sq), kEps);
  return latest_best([&](int64_t c) { return dots[c] / (new_norm * norms[c]); }, stamps, num_records, score_out);
}

// Plans layer `target` from each request's matched record `best_index` [B] of similarity
// `best_score` [B] (eqs. 6-8, the floor per request's tokens), into `planned`/`planned_probs`
// [L, E], and sets `guide` [L, E] from layer `target` on (as `FineMoEPolicy._plan_layer` and
// its guide update do).
void plan_layer(const float* maps, int64_t layer_stride, int64_t record_stride, int num_layers, int E, int batch,
                const int64_t* best_index, const float* best_score, int target, int top_k, const int32_t* num_tokens,
                uint8_t* planned, double* planned_probs, double* guide) {
  std::vector<int> order(E);
  std::vector<double> prob(E);
  double* planned_row = planned_probs + static_cast<int64_t>(target) * E;
  uint8_t* planned_flags = planned + static_cast<int64_t>(target) * E;
  for (int b = 0; b < batch; ++b) {
    const int64_t best = best_index[b];
    // eq. 7's threshold: the less the map resembles the request, the more mass to cover
    const double threshold = std::clamp(1.0 - static_cast<double>(best_score[b]), 0.0, 1.0);
    const float* row = maps + target * layer_stride + best * record_stride;
    for (int e = 0; e < E; ++e) {
      order[e] = e;
      prob[e] = row[e];
    }
    std::stable_sort(order.begin(), order.end(), [&](int a, int c) { return prob[a] > prob[c]; });
    int count = E;  // rounding can leave the total a hair under a threshold of 1: every expert
    double covered = 0.0;
    for (int i = 0; i < E; ++i) {
      covered += prob[order[i]];
      if (covered >= threshold) {
        count = i + 1;
        break;
      }
    }
    // eq. 8's floor: K for one token; for T > 1 tokens the expected size of the union of their
    // top-K (selection.iteration_floor)
    int floor = top_k;
    if (num_tokens[b] > 1) {
      double expected = 0.0;
      for (int e = 0; e < E; ++e) {
        const double q = std::min(1.0, top_k * prob[e]);
        expected += 1.0 - std::pow(1.0 - q, static_cast<double>(num_tokens[b]));
      }
      floor = std::clamp(static_cast<int>(std::ceil(expected - kFloorTolerance)), top_k, E);
    }
    count = std::max(count, floor);
    for (int i = 0; i < count; ++i) {
      const int e = order[i];
      planned_flags[e] = 1;
      planned_row[e] = std::max(planned_row[e], prob[e]);
    }
  }
  // eviction's p from layer `target` on: the largest over the batch's matched maps
  for (int l = target; l < num_layers; ++l) {
    for (int e = 0; e < E; ++e) {
      float m = -std::numeric_limits<float>::infinity();
      for (int b = 0; b < batch; ++b) m = std::max(m, maps[l * layer_stride + best_index[b] * record_stride + e]);
      guide[static_cast<int64_t>(l) * E + e] = m;
    }
  }
}

}  // namespace

extern "C" {

// maps: the store's [L, C_cap, E] fp32 maps (layer stride `layer_stride`, record stride
// `record_stride`, in elements), the first `num_records` records valid; `columns` the same maps
// as [L, E, C_cap] (strides `column_layer_stride`, `column_expert_stride`; records contiguous),
// which the dot products read.
// norms: [L, C] the records' trajectory norms over layers 0..l (floored at eps).
// observed: [B, L, E] the iteration's gate distributions per request (layer `layer` is read).
// dots [B, C], new_sq [B]: the running sums, updated in place.
// target: the layer to plan (< 0: only update the sums); num_tokens [B]: each request's tokens in
// the iteration (>= 1, eq. 8's floor). planned [L, E] (uint8),
// planned_probs [L, E] and guide [L, E] (fp64) are updated as `FineMoEPolicy` does.
// best_index [B], best_score [B]: the matches found (when planning).
// probs_in (may be null): the layer's gate distributions [B, E], copied into `observed` first (a
// decode step's router output, one row per request: the caller's NumPy copy saved).
// last_matched (may be null): the store's [C] stamps of the last match; the matched records get
// `num_added` (`ExpertMapStore.mark_matched`) when planning.
// Returns 0, or 1 for arguments out of range (nothing written).
int emoe_finemoe_observe(const float* maps, int64_t layer_stride, int64_t record_stride, int64_t num_records,
                         int num_layers, int num_experts, const float* columns, int64_t column_layer_stride,
                         int64_t column_expert_stride, const float* norms, const int64_t* stamps,
                         float* observed, int batch, float* dots, float* new_sq, int layer, int target,
                         int top_k, const int32_t* num_tokens, uint8_t* planned, double* planned_probs,
                         double* guide, int64_t* best_index, float* best_score, const float* probs_in,
                         int64_t* last_matched, int64_t num_added) {
  const int E = num_experts;
  if (num_records < 1 || batch < 1 || E < 1 || layer < 0 || layer >= num_layers || target >= num_layers ||
      (target >= 0 && (target <= layer || top_k < 1 || top_k > E))) {
    return 1;
  }
  if (probs_in != nullptr) {
    for (int b = 0; b < batch; ++b) {
      std::copy(probs_in + static_cast<int64_t>(b) * E, probs_in + static_cast<int64_t>(b + 1) * E,
                observed + (static_cast<int64_t>(b) * num_layers + layer) * E);
    }
  }
  const float* layer_columns = columns + layer * column_layer_stride;
  const float* probs = observed + layer * num_experts;  // observed [B, L, E]: this layer's rows
  const int64_t probs_stride = static_cast<int64_t>(num_layers) * E;
  for (int b = 0; b < batch; ++b) {
    const float* p = probs + b * probs_stride;
    float sq = 0.f;
    for (int e = 0; e < E; ++e) sq += p[e] * p[e];
    new_sq[b] += sq;
    // The records side by side (one expert's column of every record is contiguous): each expert
    // adds p[e] times its column to the sums, a vector FMA per 16 records, where a record-major
    // layout would need a horizontal sum per record. Each record's sum still runs over e in order.
    float* __restrict d = dots + b * num_records;
    for (int e = 0; e < E; ++e) {
      const float pe = p[e];
      const float* __restrict column = layer_columns + e * column_expert_stride;
      for (int64_t c = 0; c < num_records; ++c) d[c] += pe * column[c];
    }
  }
  if (target < 0) return 0;
  norms += static_cast<int64_t>(layer) * num_records;  // norms [L, C]: over layers 0..layer

  for (int b = 0; b < batch; ++b) {
    best_index[b] = best_record(dots + b * num_records, new_sq[b], norms, stamps, num_records, &best_score[b]);
  }
  if (last_matched != nullptr) {
    for (int b = 0; b < batch; ++b) last_matched[best_index[b]] = num_added;
  }
  plan_layer(maps, layer_stride, record_stride, num_layers, E, batch, best_index, best_score, target, top_k, num_tokens,
             planned, planned_probs, guide);
  return 0;
}

// Plans layer `target` from matches found elsewhere (the semantic search of the iteration's first
// layers, eq. 4): `best_index` [B] records of the first `num_records`, `best_score` [B]. The other
// arguments are `emoe_finemoe_observe`'s. Returns 0, or 1 for arguments out of range.
int emoe_finemoe_plan(const float* maps, int64_t layer_stride, int64_t record_stride, int64_t num_records,
                      int num_layers, int num_experts, int batch, const int64_t* best_index, const float* best_score,
                      int target, int top_k, const int32_t* num_tokens, uint8_t* planned, double* planned_probs,
                      double* guide) {
  if (num_records < 1 || batch < 1 || num_experts < 1 || target < 0 || target >= num_layers || top_k < 1 ||
      top_k > num_experts) {
    return 1;
  }
  for (int b = 0; b < batch; ++b) {
    if (best_index[b] < 0 || best_index[b] >= num_records || num_tokens[b] < 1) return 1;
  }
  plan_layer(maps, layer_stride, record_stride, num_layers, num_experts, batch, best_index, best_score, target, top_k,
             num_tokens, planned, planned_probs, guide);
  return 0;
}

// A prefetch plan (§4.5, `ranking.plan_from_predictions`): the experts of layers after
// `current_layer` that are `planned` and not `resident` ([L, E] masks), by descending priority
// probs / (layer - current_layer) (fp64, `selection.prefetch_priority`), ties in (layer, expert)
// order. Writes their flat indices and priorities to `out_index` and `out_priority` (room for
// L * E); returns how many, or -1 for arguments out of range.
int64_t emoe_plan_from_predictions(const uint8_t* planned, const double* probs, const uint8_t* resident,
                                   int current_layer, int num_layers, int num_experts, int64_t* out_index,
                                   double* out_priority) {
  if (current_layer < -1 || current_layer >= num_layers || num_experts < 1) return -1;
  struct Item {
    double priority;
    int64_t index;
  };
  std::vector<Item> items;  // mostly none: no allocation then
  for (int layer = current_layer + 1; layer < num_layers; ++layer) {
    const int64_t row = static_cast<int64_t>(layer) * num_experts;
    for (int64_t i = row; i < row + num_experts; ++i) {
      if (planned[i] && !resident[i]) items.push_back({probs[i] / static_cast<double>(layer - current_layer), i});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.priority > b.priority; });
  for (size_t j = 0; j < items.size(); ++j) {
    out_index[j] = items[j].index;
    out_priority[j] = items[j].priority;
  }
  return static_cast<int64_t>(items.size());
}

// FineMoE's victims (§4.5): up to `num_victims` of the `size` experts (flat [L, E] index) that are
// `resident` and not `protected_mask`ed, first to go first: by descending 1 / (max(p, prob_floor) *
// (visits + 1)) with p from `guide` and visits from `num_uses` (`selection.eviction_priority`, the
// same fp64 operations in the same order), ties to the oldest `last_used`, then to the lower index
// (`ranking.pick_victims`). Writes their indices to `out`; returns how many (fewer when fewer are
// candidates), or -1 for arguments out of range.
int64_t emoe_finemoe_victims(const double* guide, const int64_t* num_uses, const int64_t* last_used,
                             const uint8_t* resident, const uint8_t* protected_mask, int64_t size, int64_t num_victims,
                             double prob_floor, int64_t* out) {
  if (size < 0 || num_victims < 0) return -1;
  struct Candidate {
    double priority;
    int64_t stamp;
    int64_t index;
  };
  std::vector<Candidate> candidates;
  candidates.reserve(static_cast<size_t>(size));
  for (int64_t i = 0; i < size; ++i) {
    if (!resident[i] || protected_mask[i]) continue;
    const double p = std::max(guide[i], prob_floor);
    candidates.push_back({1.0 / (p * (static_cast<double>(num_uses[i]) + 1.0)), last_used[i], i});
  }
  const int64_t count = std::min<int64_t>(num_victims, static_cast<int64_t>(candidates.size()));
  std::partial_sort(candidates.begin(), candidates.begin() + count, candidates.end(),
                    [](const Candidate& a, const Candidate& b) {
                      if (a.priority != b.priority) return a.priority > b.priority;
                      if (a.stamp != b.stamp) return a.stamp < b.stamp;
                      return a.index < b.index;
                    });
  for (int64_t j = 0; j < count; ++j) out[j] = candidates[j].index;
  return count;
}

// §4.4's placement of `batch` new records in a full Expert Map Store of `capacity` records, one at
// a time in order (`ExpertMapStore.insert_many`'s loop for a full store): record r replaces the
// stored record of the highest `redundancy[r] + staleness` (ties to the highest stamp), is written
// there, and the later records' redundancy with that slot is updated. The store's arrays:
// `embeddings` [cap, h] and `embedding_norms` [cap]; `maps` [L, cap, E] and `columns` [L, E, cap]
// (contiguous); `trajectory_norms` [L, cap]; `stamps` and `last_matched` [cap]; `num_added` the
// records added so far. The new records: `new_embeddings` [B, h] and `new_maps` [B, L * E];
// `redundancy` [B, cap]: their fp32 RDY against the store as it stood (updated in place), or, with
// `semantic` given, written first from the iteration's searches: eq. 4's scores `semantic` [B, cap]
// and eq. 5's sums over every layer (`trajectory_dots` [B, cap], the records' squared norms
// `trajectory_sq` [B], the stored maps' norms floored at eps `trajectory_norms_in` [cap]), as
// `SearchedScores` and `ExpertMapStore._rdy` combine them; `w_sem` RDY's semantic weight d / L.
// The arithmetic is the NumPy reference's, operation by operation in the same precision (staleness
// in fp64, rounded to fp32 before the sum); only the dot products' and norms' sums run in another
// order, and the compiler may fuse RDY's multiply and add. Writes the slots to `slots`; returns
// the new `num_added`, or -1 for arguments out of range (nothing written).
int64_t emoe_finemoe_place(float* embeddings, float* embedding_norms, float* maps, float* columns,
                           float* trajectory_norms, int64_t* stamps, int64_t* last_matched, int64_t capacity,
                           int num_layers, int num_experts, int hidden, const float* new_embeddings,
                           const float* new_maps, int batch, float* redundancy, const float* semantic,
                           const float* trajectory_dots, const float* trajectory_sq, const float* trajectory_norms_in,
                           double w_sem, int64_t num_added, int64_t* slots) {
  if (capacity < 1 || num_layers < 1 || num_experts < 1 || hidden < 1 || batch < 0) return -1;
  const int64_t map_size = static_cast<int64_t>(num_layers) * num_experts;
  const float w_semantic = static_cast<float>(w_sem);
  const float w_trajectory = static_cast<float>(1.0 - w_sem);
  if (semantic != nullptr) {  // RDY from the iteration's own searches (`SearchedScores`)
    for (int r = 0; r < batch; ++r) {
      const float new_norm = std::max(std::sqrt(trajectory_sq[r]), kEps);
      const int64_t row = static_cast<int64_t>(r) * capacity;
      for (int64_t c = 0; c < capacity; ++c) {
        const float trajectory_cos = trajectory_dots[row + c] / (new_norm * trajectory_norms_in[c]);
        redundancy[row + c] = w_semantic * semantic[row + c] + w_trajectory * trajectory_cos;
      }
    }
  }
  // the new records' norms (`map_store._norms`): their embeddings' and their whole maps'
  std::vector<float> new_embedding_norms(batch), new_map_norms(batch);
  for (int r = 0; r < batch; ++r) {
    const float* e = new_embeddings + static_cast<int64_t>(r) * hidden;
    const float* p = new_maps + r * map_size;
    float e_sq = 0.f, p_sq = 0.f;
    for (int k = 0; k < hidden; ++k) e_sq += e[k] * e[k];
    for (int64_t x = 0; x < map_size; ++x) p_sq += p[x] * p[x];
    new_embedding_norms[r] = std::sqrt(e_sq);
    new_map_norms[r] = std::sqrt(p_sq);
  }
  for (int r = 0; r < batch; ++r) {
    const float* row = redundancy + static_cast<int64_t>(r) * capacity;
    float total;
    const int64_t slot = latest_best(
        [&](int64_t c) {
          const double age = static_cast<double>(num_added - last_matched[c]);
          return row[c] + static_cast<float>(std::max(age / static_cast<double>(capacity) - 1.0, 0.0));
        },
        stamps, capacity, &total);
    slots[r] = slot;
    // the record, as `ExpertMapStore._write`
    const float* e = new_embeddings + static_cast<int64_t>(r) * hidden;
    const float* p = new_maps + r * map_size;
    std::copy(e, e + hidden, embeddings + slot * hidden);
    embedding_norms[slot] = new_embedding_norms[r];
    float cumulative = 0.f;
    for (int l = 0; l < num_layers; ++l) {
      float layer_sq = 0.f;
      for (int x = 0; x < num_experts; ++x) {
        const float v = p[l * num_experts + x];
        maps[(static_cast<int64_t>(l) * capacity + slot) * num_experts + x] = v;
        columns[(static_cast<int64_t>(l) * num_experts + x) * capacity + slot] = v;
        layer_sq += v * v;
      }
      cumulative += layer_sq;
      trajectory_norms[static_cast<int64_t>(l) * capacity + slot] = std::sqrt(cumulative);
    }
    stamps[slot] = last_matched[slot] = num_added++;
    // the later records now meet this one in its slot (`_rdy` of two `_cosine`s)
    const float slot_norm = std::max(embedding_norms[slot], kEps);
    const float* last_layer_norms = trajectory_norms + static_cast<int64_t>(num_layers - 1) * capacity;
    const float slot_map_norm = std::max(last_layer_norms[slot], kEps);
    for (int later = r + 1; later < batch; ++later) {
      const float* e2 = new_embeddings + static_cast<int64_t>(later) * hidden;
      const float* p2 = new_maps + later * map_size;
      float sem_dot = 0.f;
      for (int k = 0; k < hidden; ++k) sem_dot += e2[k] * e[k];
      float map_dot = 0.f;
      for (int64_t x = 0; x < map_size; ++x) map_dot += p2[x] * p[x];
      const float semantic_cos = sem_dot / (std::max(new_embedding_norms[later], kEps) * slot_norm);
      const float trajectory_cos = map_dot / (std::max(new_map_norms[later], kEps) * slot_map_norm);
      float* later_row = redundancy + static_cast<int64_t>(later) * capacity;
      later_row[slot] = w_semantic * semantic_cos + w_trajectory * trajectory_cos;
    }
  }
  return num_added;
}

// Eq. 4's epilogue: `scores` [B, C] holds the dot products of the queries [B, h] with the first
// `num_records` stored embeddings (BLAS's matrix product: it reads the store once for the whole
// batch) and becomes their cosines, dot / (max(|q|, eps) * max(|s|, eps)) in fp32 as
// `map_store._cosine`, with `stored_norms` [C] the |s|; per query the best record goes to
// `best_index`/`best_score` [B] (equal scores to the highest `stamps`, as `map_store.latest_best`)
// and, with `last_matched` (may be null), is stamped `num_added` (`ExpertMapStore.mark_matched`).
// Returns 0, or 1 for arguments out of range.
int emoe_finemoe_semantic_best(float* scores, const float* queries, int batch, int hidden, const float* stored_norms,
                               const int64_t* stamps, int64_t num_records, int64_t* best_index, float* best_score,
                               int64_t* last_matched, int64_t num_added) {
  if (batch < 1 || hidden < 1 || num_records < 1) return 1;
  for (int b = 0; b < batch; ++b) {
    const float* q = queries + static_cast<int64_t>(b) * hidden;
    float q_sq = 0.f;
    for (int k = 0; k < hidden; ++k) q_sq += q[k] * q[k];
    const float q_norm = std::max(std::sqrt(q_sq), kEps);
    float* row = scores + b * num_records;
    for (int64_t c = 0; c < num_records; ++c) row[c] = row[c] / (q_norm * std::max(stored_norms[c], kEps));
    best_index[b] = latest_best([row](int64_t c) { return row[c]; }, stamps, num_records, &best_score[b]);
    if (last_matched != nullptr) last_matched[best_index[b]] = num_added;
  }
  return 0;
}

}  // extern "C"
