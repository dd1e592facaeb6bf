// Fused HSTU attention tiles for CPU (fp32; GEMMs in bf16 math when asked): one chunk of one group of
// gr.hstu.kernels.attention.cpu.
//
// Per (sequence, head) of a chunk the scores tile [C, K] is made by one GEMM, then bias, SiLU,
// mask and (in backward) the SiLU gradient and the bias-gradient scatter run over it while it
// sits in this core's cache, then the next GEMM reads it. The unfused path makes a pass over
// the whole chunk's [G, H, C, K] scores in memory for each of those steps.
//
// Forward can keep each row block's weights and SiLU' (packed, streamed past the cache) for backward,
// which then reads them instead of running the scores GEMM, bias, exp and SiLU again.
//
// GEMMs are gr_gemm's (AVX-512, or MKL's sgemm_ without it), one thread each inside at::parallel_for
// over (sequence, head); each (sequence, head)'s keys and values are transposed once for all its
// row blocks, so that every GEMM reads its B operand in rows. Built and loaded by gr/ops/native.py;
// gr/hstu/kernels/attention/cpu.py runs the unfused kernel when this cannot be built or linked.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "gr_blas.h"
#include "gr_gemm.h"
#include "gr_parallel.h"
#include "gr_silu.h"
#include "gr_stream.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <optional>
#include <utility>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using at::Tensor;

using at::IntArrayRef;

constexpr int64_t ROW_BLOCK = 32;  // query rows per GEMM: each block meets only the keys its rows see
constexpr int64_t kMaxSlots = 64;  // slots of sequences, each with its own bias-gradient sums
// With several heads, a sequence's bias (forward) and its dS summed over heads (for the bias
// gradients, backward) are made once for all heads while they fit this many floats per thread.
constexpr int64_t kSharedBias = 1 << 16;

// A [T, H, D] fp32 jagged tensor with contiguous rows of D (e.g. q, k, v split from one projection):
// the rows of head h from token `first` on, with their stride.
struct Jagged {
  float* data;
  int64_t heads, ld, head_stride;
  explicit Jagged(const Tensor& t)
      : data(t.data_ptr<float>()), heads(t.size(1)), ld(t.stride(0)), head_stride(t.stride(1)) {
    TORCH_CHECK(t.dim() == 3 && t.scalar_type() == at::kFloat && t.stride(2) == 1,
                "cpu_fused: expected an fp32 [T, H, D] tensor whose last dimension is contiguous");
  }
  float* rows(int64_t first, int64_t h) const { return data + first * ld + h * head_stride; }
};

// Partial histograms the time-bias gradient is summed into, added up after the call: element j of a
// row goes to part j mod kTimeParts.
constexpr int64_t kTimeParts = 8;

// acc[part(j) * NB + idx[j]] += d[j] for j < n. Neighbouring keys often share a bucket (timestamps are
// sorted): in one histogram each of their adds would wait for the last one's store. With 8 parts a
// bucket's adds chain only every 8th element. (Summing each run of equal buckets in vector lanes, as
// before, paid a horizontal sum per run: at ML-1M's lengths a run is ~7 keys long, and that was
// ~45 % of the backward's own time for 2 heads of 25.)
template <typename Index>
void add_to_parts(const Index* __restrict idx, const float* __restrict d, int64_t n, float* __restrict acc,
                  int64_t NB) {
  int64_t j = 0;
  for (; j + kTimeParts <= n; j += kTimeParts)
    for (int64_t part = 0; part < kTimeParts; ++part) acc[part * NB + idx[j + part]] += d[j + part];
  for (int64_t part = 0; j < n; ++j, ++part) acc[part * NB + idx[j]] += d[j];
}

// s[j] += w[idx[j]] for j < n (restrict: so that it vectorises, as a gather).
template <typename Index>
void add_lookup(const Index* __restrict idx, const float* __restrict w, float* __restrict s, int64_t n) {
  for (int64_t j = 0; j < n; ++j) s[j] += w[idx[j]];
}

// One chunk of one group: query rows [m0, m0 + C) of each sequence against its keys [lo, lo + K), the
// sequences' first tokens and lengths, and what the elementwise work reads (bias, mask, normaliser).
struct Chunk {
  int64_t G, C, K, m0, lo, mask_from;
  const int64_t* starts;
  const int64_t* lengths;
  const float* pos_w = nullptr;
  int64_t P = 0;
  const int32_t* row_pos = nullptr;  // [Gp, C]: each query's position (its row, or the history length)
  bool pos_shared = false;
  const float* time_w = nullptr;
  const void* time_idx = nullptr;  // [G, C, K] uint8 (bytes) or int32
  bool time_idx_bytes = false;
  const float* mask = nullptr;        // [Gm, 1, C, K - mask_from]
  bool mask_shared = false;
  const int64_t* row_end = nullptr;  // [Gm, C]: 1 + the last key column row i may see
  const float* norm = nullptr;       // [Gn, 1, C, 1]
  bool norm_shared = false;

  Chunk(const Tensor& starts_, const Tensor& lengths_, int64_t C_, int64_t K_, int64_t m0_, int64_t lo_,
        const std::optional<Tensor>& pos_w_, const std::optional<Tensor>& row_pos_,
        const std::optional<Tensor>& time_w_, const std::optional<Tensor>& time_idx_,
        const std::optional<Tensor>& mask_, int64_t mask_from_, const std::optional<Tensor>& row_end_,
        const Tensor& norm_)
      : G(starts_.numel()), C(C_), K(K_), m0(m0_), lo(lo_), mask_from(mask_from_) {
    TORCH_CHECK(starts_.scalar_type() == at::kLong && lengths_.scalar_type() == at::kLong &&
                    starts_.is_contiguous() && lengths_.is_contiguous() && lengths_.numel() == G,
                "cpu_fused: starts and lengths must be contiguous int64 [G]");
    starts = starts_.data_ptr<int64_t>();
    lengths = lengths_.data_ptr<int64_t>();
    if (pos_w_.has_value()) {
      TORCH_CHECK(row_pos_.has_value() && row_pos_->is_contiguous() && row_pos_->scalar_type() == at::kInt &&
                      row_pos_->size(-1) == C,
                  "cpu_fused: row positions must be contiguous int32 [G or 1, C]");
      pos_w = pos_w_->data_ptr<float>();
      P = pos_w_->numel();
      row_pos = row_pos_->data_ptr<int32_t>();
      pos_shared = row_pos_->size(0) == 1;
    }
    if (time_w_.has_value()) {
      TORCH_CHECK(time_idx_.has_value() && time_idx_->is_contiguous() &&
                      (time_idx_->scalar_type() == at::kInt || time_idx_->scalar_type() == at::kByte) &&
                      time_idx_->size(-1) == K && time_idx_->size(-2) == C,
                  "cpu_fused: time buckets must be contiguous uint8 or int32 [G, C, K]");
      time_w = time_w_->data_ptr<float>();
      time_idx = time_idx_->data_ptr();
      time_idx_bytes = time_idx_->scalar_type() == at::kByte;
    }
    if (mask_.has_value()) {
      TORCH_CHECK(mask_->is_contiguous() && mask_->scalar_type() == at::kFloat && mask_->size(-1) == K - mask_from,
                  "cpu_fused: mask must be a contiguous fp32 [Gm, 1, C, K - mask_from] tensor");
      mask = mask_->data_ptr<float>();
      mask_shared = mask_->size(0) == 1;
      TORCH_CHECK(row_end_.has_value() && row_end_->is_contiguous() && row_end_->scalar_type() == at::kLong &&
                      row_end_->numel() == mask_->size(0) * C,
                  "cpu_fused: row_end must be contiguous int64 [Gm, C] with a mask");
      row_end = row_end_->data_ptr<int64_t>();
    }
    TORCH_CHECK(norm_.is_contiguous() && norm_.scalar_type() == at::kFloat, "cpu_fused: norm must be contiguous fp32");
    norm = norm_.data_ptr<float>();
    norm_shared = norm_.size(0) == 1;
  }

  // Query rows of sequence g in this chunk, and the key columns it has (both cut at its length).
  int64_t rows_of(int64_t g) const { return std::max<int64_t>(0, std::min(C, lengths[g] - m0)); }
  int64_t keys_of(int64_t g) const { return std::max<int64_t>(0, std::min(K, lengths[g] - lo)); }
  // Key columns rows [r0, r1) of sequence g need: past the last one any of them may see, all are masked.
  int64_t keys_seen(int64_t g, int64_t r0, int64_t r1, int64_t keys) const {
    if (mask == nullptr) return keys;
    const int64_t* end = row_end + (mask_shared ? 0 : g) * C;
    int64_t seen = 0;
    for (int64_t i = r0; i < r1; ++i) seen = std::max(seen, end[i]);
    return std::min(seen, keys);
  }
  // Score elements of sequence g's row blocks in this chunk (per head): what backward reads back when
  // forward keeps its tiles.
  int64_t tiles_of(int64_t g) const {
    const int64_t nrows = rows_of(g), nkeys = keys_of(g);
    int64_t tiles = 0;
    for (int64_t r0 = 0; r0 < nrows; r0 += ROW_BLOCK) {
      const int64_t r1 = std::min(r0 + ROW_BLOCK, nrows);
      tiles += (r1 - r0) * keys_seen(g, r0, r1, nkeys);
    }
    return tiles;
  }
  float norm_of(int64_t g, int64_t i) const { return norm[(norm_shared ? 0 : g) * C + i]; }

  // Key columns of row i of sequence g by position bucket: the bucket of column j is base - j
  // (query position minus key position) on [lo, hi), P - 1 before lo and 0 from hi on (keys in the
  // query's future: masked, or contextual keys every query sees).
  struct Diagonal {
    int64_t base, lo, hi;
  };
  Diagonal diagonal(int64_t g, int64_t i, int64_t n) const {
    const int64_t base = row_pos[(pos_shared ? 0 : g) * C + i] - lo;
    return {base, std::min(n, std::max<int64_t>(0, base - (P - 1))), std::min(n, std::max<int64_t>(0, base + 1))};
  }

  // f(row i of sequence g's time buckets), as stored (uint8 or int32).
  template <typename F>
  void time_buckets_of(int64_t g, int64_t i, const F& f) const {
    const int64_t row = (g * C + i) * K;
    if (time_idx_bytes)
      f(static_cast<const uint8_t*>(time_idx) + row);
    else
      f(static_cast<const int32_t*>(time_idx) + row);
  }

  bool has_bias() const { return pos_w != nullptr || time_w != nullptr; }
  // bias[rows, n] (rows n apart) = the bias of rows [r0, r1) of sequence g.
  void bias_rows(int64_t g, int64_t r0, int64_t r1, int64_t n, float* bias) const {
    for (int64_t i = r0; i < r1; ++i) {
      float* row = bias + (i - r0) * n;
      std::fill(row, row + n, 0.0f);
      add_bias(g, i, row, n);
    }
  }
  // s[0, n) = s + bias of row i of sequence g.
  void add_bias(int64_t g, int64_t i, float* s, int64_t n) const {
    if (pos_w != nullptr) {
      const Diagonal d = diagonal(g, i, n);
      for (int64_t j = 0; j < d.lo; ++j) s[j] += pos_w[P - 1];
      const float* w = pos_w + d.base;
      for (int64_t j = d.lo; j < d.hi; ++j) s[j] += *(w - j);
      for (int64_t j = d.hi; j < n; ++j) s[j] += pos_w[0];
    }
    if (time_w != nullptr) time_buckets_of(g, i, [&](const auto* idx) { add_lookup(idx, time_w, s, n); });
  }
  // w[0, n) *= the mask of row i (columns >= mask_from).
  void apply_mask(int64_t g, int64_t i, float* w, int64_t n) const {
    if (mask == nullptr || n <= mask_from) return;
    const float* m = mask + ((mask_shared ? 0 : g) * C + i) * (K - mask_from);
    float* tail = w + mask_from;
    for (int64_t j = 0; j < n - mask_from; ++j) tail[j] *= m[j];
  }
  // dpos / dtime (thread-local, may be null) += d[0, n) into the buckets of row i; dtime holds
  // kTimeParts partial histograms of NB buckets.
  void add_bias_grads(int64_t g, int64_t i, const float* d, int64_t n, float* dpos, float* dtime, int64_t NB) const {
    if (dpos != nullptr) {
      const Diagonal diag = diagonal(g, i, n);
      float far = 0.0f, ahead = 0.0f;
      for (int64_t j = 0; j < diag.lo; ++j) far += d[j];
      for (int64_t j = diag.hi; j < n; ++j) ahead += d[j];
      dpos[P - 1] += far;
      dpos[0] += ahead;
      float* acc = dpos + diag.base;
      for (int64_t j = diag.lo; j < diag.hi; ++j) *(acc - j) += d[j];
    }
    if (dtime != nullptr) time_buckets_of(g, i, [&](const auto* idx) { add_to_parts(idx, d, n, dtime, NB); });
  }
};

// Rows [r0, r1) (of the chunk) of sequence g against n keys: scores[rows, n] = alpha q k^T + bias,
// weights = SiLU(scores) under the mask; both with row stride ld. kt: the keys transposed, [D, ldk].
// kGradient: scores then hold SiLU'(scores) = sig (1 + s (1 - sig)), from the same exp. bias: the
// rows' bias made once for all heads ([rows, n], Chunk::bias_rows), or null: added here.
template <bool kGradient>
void scores_and_weights(gr_gemm::Gemm gemm, const Chunk& c, int64_t g, int64_t r0, int64_t r1, int64_t n, float alpha,
                        const float* q, int64_t ldq, const float* kt, int64_t ldk, int64_t D, float* scores,
                        float* weights, int64_t ld, const float* bias) {
  gemm(false, false, r1 - r0, n, D, alpha, q, ldq, kt, ldk, 0.0f, scores, ld);
  for (int64_t i = r0; i < r1; ++i) {
    float* __restrict s = scores + (i - r0) * ld;
    float* __restrict w = weights + (i - r0) * ld;
    if (bias != nullptr) {
      const float* __restrict b = bias + (i - r0) * n;
      for (int64_t j = 0; j < n; ++j) s[j] += b[j];
    } else {
      c.add_bias(g, i, s, n);
    }
    gr_silu::silu(s, w, kGradient ? s : nullptr, n);
    c.apply_mask(g, i, w, n);
  }
}

// One sequence g of a group, with the group's chunks [first, last) of the call.
struct Item {
  int64_t first, last, g;
};

// The call's sequences sorted by their work (score elements of their row blocks plus their keys),
// most first, in at most kMaxSlots slots of consecutive ones: threads take a slot at a time
// (dynamic_for), the biggest first, and each slot keeps its own bias-gradient sums.
struct ItemSlots {
  std::vector<Item> items;  // in order of decreasing work
  std::vector<int64_t> tiles_before;  // [items + 1]: score elements per head of the items before each
  int64_t per_slot, count;
};

ItemSlots item_slots(const std::vector<Chunk>& chunks, IntArrayRef group) {
  std::vector<Item> items;
  std::vector<int64_t> work, tiles;
  for (int64_t first = 0, last = 0; first < static_cast<int64_t>(chunks.size()); first = last) {
    while (last < static_cast<int64_t>(chunks.size()) && group[last] == group[first]) ++last;
    for (int64_t g = 0; g < chunks[first].G; ++g) {
      int64_t keys = 0, scores = 0;
      for (int64_t ci = first; ci < last; ++ci) {
        if (chunks[ci].rows_of(g) > 0) keys += chunks[ci].keys_of(g);
        scores += chunks[ci].tiles_of(g);
      }
      items.push_back({first, last, g});
      work.push_back(keys + scores);
      tiles.push_back(scores);
    }
  }
  std::vector<int64_t> order(items.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return work[x] > work[y]; });
  ItemSlots slots;
  slots.tiles_before.push_back(0);
  for (int64_t i : order) {
    slots.items.push_back(items[i]);
    slots.tiles_before.push_back(slots.tiles_before.back() + tiles[i]);
  }
  const int64_t n = static_cast<int64_t>(items.size());
  slots.per_slot = std::max<int64_t>(1, (n + kMaxSlots - 1) / kMaxSlots);
  slots.count = (n + slots.per_slot - 1) / slots.per_slot;
  return slots;
}

// A call's chunks, its widest chunk's keys (the per-thread tiles' row length) and its sequences in slots.
struct Call {
  std::vector<Chunk> chunks;
  int64_t K;
  ItemSlots slots;
};

// The chunks of one call, as lists (chunk c: rows [m0[c], m0[c] + rows[c]) of the sequences of group
// group[c] against its keys [lo[c], hi[c]); the chunks of a group adjacent) -> the Call.
struct ChunkArgs {
  at::TensorList starts, lengths;  // per group: [G] int64 each
  at::IntArrayRef group, rows, m0, lo, hi, mask_from;
  const c10::List<std::optional<Tensor>>& row_pos;
  const c10::List<std::optional<Tensor>>& time_idx;
  const c10::List<std::optional<Tensor>>& mask;
  const c10::List<std::optional<Tensor>>& row_end;
  at::TensorList norm;

  Call make(const std::optional<Tensor>& pos_w, const std::optional<Tensor>& time_w) const {
    const size_t n = group.size();
    TORCH_CHECK(rows.size() == n && m0.size() == n && lo.size() == n && hi.size() == n && mask_from.size() == n &&
                    row_pos.size() == n && time_idx.size() == n && mask.size() == n && row_end.size() == n &&
                    norm.size() == n && starts.size() == lengths.size(),
                "cpu_fused: one value per chunk in each chunk list, one starts and lengths per group");
    std::vector<Chunk> chunks;
    for (size_t c = 0; c < n; ++c) {
      TORCH_CHECK(group[c] >= 0 && group[c] < static_cast<int64_t>(starts.size()) &&
                      (c == 0 || group[c] >= group[c - 1]),
                  "cpu_fused: chunk ", c, "'s group must index starts and the chunks of a group be adjacent");
      chunks.emplace_back(starts[group[c]], lengths[group[c]], rows[c], hi[c] - lo[c], m0[c], lo[c], pos_w,
                          row_pos.get(c), time_w, time_idx.get(c), mask.get(c), mask_from[c], row_end.get(c),
                          norm[c]);
    }
    int64_t K = 1;
    for (const Chunk& c : chunks) K = std::max(K, c.K);
    ItemSlots slots = item_slots(chunks, group);
    return {std::move(chunks), K, std::move(slots)};
  }
};

// Where a (chunk, sequence, head)'s row blocks start. tiles: in a buffer that keeps two floats per score
// element of the call (weights and SiLU', block after block: Chunk::tiles_of), the same in forward and
// backward; within: the score elements of the sequence's earlier chunks (one head's), of
// item_scores in all its chunks.
struct Place {
  int64_t tiles, within, item_scores;
};

// Whether the heads of a sequence with item_scores score elements a head share its bias and dS sums.
bool shares_bias(int64_t H, int64_t item_scores) { return H > 1 && item_scores <= kSharedBias; }

// The next row block's m x n tile of a buffer packed block after block (null while the buffer is
// null); the cursor moves past it.
float* next_tile(float*& cursor, int64_t m, int64_t n) {
  float* tile = cursor;
  if (cursor != nullptr) cursor += m * n;
  return tile;
}

// Runs body(scratch, slot, chunk, g, h, first, place) for every head h and chunk of every sequence g of
// the call (first: the sequence's first chunk in the call; place: Place), with one scratch =
// make_scratch() per thread. A sequence's heads run one after the other, each over all its chunks.
// The slots go to whichever thread is free: the sequences of a batch differ in length up to 10x, and
// one call per group with an equal count of them per thread left one thread idle. A sequence's
// chunks and heads stay in one slot, so the k and v gradients it accumulates have one writer, and so
// do the cache lines its heads share. The slots depend on the lengths only: so do the sums.
template <typename MakeScratch, typename Body>
void for_each_item(const Call& call, int64_t H, const MakeScratch& make_scratch, const Body& body) {
  const ItemSlots& slots = call.slots;
  const std::vector<Chunk>& chunks = call.chunks;
  const int64_t n = static_cast<int64_t>(slots.items.size());
  gr_parallel::dynamic_for(slots.count, make_scratch, [&](auto& scratch, int64_t slot) {
    for (int64_t i = slot * slots.per_slot; i < std::min(n, (slot + 1) * slots.per_slot); ++i) {
      const Item& item = slots.items[i];
      const int64_t item_scores = slots.tiles_before[i + 1] - slots.tiles_before[i];
      int64_t tiles = 2 * H * slots.tiles_before[i];
      for (int64_t h = 0; h < H; ++h)
        for (int64_t c = item.first, within = 0; c < item.last; ++c) {
          body(scratch, slot, chunks[c], item.g, h, c == item.first, Place{tiles, within, item_scores});
          const int64_t scores = chunks[c].tiles_of(item.g);
          tiles += 2 * scores;
          within += scores;
        }
    }
  });
}

// rows [0, n) of width w, ld apart, = 0.
void zero_rows(float* rows, int64_t n, int64_t w, int64_t ld) {
  for (int64_t r = 0; r < n; ++r) std::fill(rows + r * ld, rows + r * ld + w, 0.0f);
}

// Floats that keep a call's tiles for backward: weights and SiLU' per score element of every head.
int64_t saved_tile_floats(const Call& call, int64_t H) { return 2 * H * call.slots.tiles_before.back(); }

// out rows of every chunk = norm * (SiLU(alpha q k^T + bias) * mask) v, for every sequence and head;
// rows that see no key are left as they are, or with zero_unseen set to zero (out may then be
// uninitialised when the call's chunks hold every row of every sequence). -> the tiles' weights and
// SiLU' for backward_chunks, [saved_tile_floats], when there are at most save_limit of those floats
// (backward then reads them instead of computing them again), else an empty tensor.
Tensor forward_chunks(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                      const std::optional<Tensor>& pos_w, const std::optional<Tensor>& time_w, double alpha,
                      bool zero_unseen, int64_t save_limit, at::TensorList starts, at::TensorList lengths,
                      IntArrayRef group, IntArrayRef rows, IntArrayRef m0, IntArrayRef lo, IntArrayRef hi,
                      const c10::List<std::optional<Tensor>>& row_pos,
                      const c10::List<std::optional<Tensor>>& time_idx,
                      const c10::List<std::optional<Tensor>>& mask, IntArrayRef mask_from,
                      const c10::List<std::optional<Tensor>>& row_end, at::TensorList norm, bool bf16) {
  const gr_gemm::Gemm gemm = gr_gemm::gemm_for(bf16);
  const Jagged Q(q), Kt(k), V(v), O(out);
  const int64_t H = Q.heads, D = q.size(2), Dv = v.size(2);
  const Call call =
      ChunkArgs{starts, lengths, group, rows, m0, lo, hi, mask_from, row_pos, time_idx, mask, row_end, norm}.make(
          pos_w, time_w);
  const int64_t K = call.K;
  const float a = static_cast<float>(alpha);
  const int64_t floats = saved_tile_floats(call, H);
  const bool save = floats > 0 && floats <= save_limit;
  Tensor saved = at::empty({save ? floats : 0}, q.options());
  for_each_item(
      call, H, [&] { return gr_blas::aligned_floats(ROW_BLOCK * K, ROW_BLOCK * K, D * K, H > 1 ? kSharedBias : 0); },
      [&](auto& scratch, int64_t, const Chunk& c, int64_t g, int64_t h, bool, Place place) {
        float* scores = std::get<0>(scratch).data();
        float* weights = std::get<1>(scratch).data();
        float* kt = std::get<2>(scratch).data();
        // the sequence's bias, made by its first head for all (kept packed, m x n per block)
        float* shared = c.has_bias() && shares_bias(H, place.item_scores) ? std::get<3>(scratch).data() + place.within
                                                                          : nullptr;
        int64_t tiles = place.tiles;
        const int64_t first = c.starts[g];
        const int64_t nrows = c.rows_of(g), nkeys = c.keys_of(g);
        if (nrows > 0) gr_gemm::transpose(nkeys, D, Kt.rows(first + c.lo, h), Kt.ld, kt, K);
        for (int64_t r0 = 0; r0 < nrows; r0 += ROW_BLOCK) {
          const int64_t r1 = std::min(r0 + ROW_BLOCK, nrows);
          float* o = O.rows(first + c.m0 + r0, h);
          const int64_t n = c.keys_seen(g, r0, r1, nkeys);
          if (n == 0) {
            if (zero_unseen) zero_rows(o, r1 - r0, Dv, O.ld);
            continue;
          }
          const float* qp = Q.rows(first + c.m0 + r0, h);
          const int64_t m = r1 - r0, ld = save ? n : K;  // kept tiles are packed, m x n
          float* bias = next_tile(shared, m, n);
          if (bias != nullptr && h == 0) c.bias_rows(g, r0, r1, n, bias);
          if (save)
            scores_and_weights<true>(gemm, c, g, r0, r1, n, a, qp, Q.ld, kt, K, D, scores, weights, ld, bias);
          else
            scores_and_weights<false>(gemm, c, g, r0, r1, n, a, qp, Q.ld, kt, K, D, scores, weights, ld, bias);
          gemm(false, false, m, Dv, n, 1.0f, weights, ld, V.rows(first + c.lo, h), V.ld, 0.0f, o, O.ld);
          if (save) {
            gr_stream::store_for_backward(saved.data_ptr<float>() + tiles, weights, m * n);
            gr_stream::store_for_backward(saved.data_ptr<float>() + tiles + m * n, scores, m * n);
            tiles += 2 * m * n;
          }
          for (int64_t i = r0; i < r1; ++i) {
            const float f = c.norm_of(g, i);
            float* row = o + (i - r0) * O.ld;
            for (int64_t j = 0; j < Dv; ++j) row[j] *= f;
          }
        }
      });
  return saved;
}

// Gradients of every chunk: dq rows = alpha dS k (written), dk += alpha dS^T q, dv += W^T (norm * dout),
// dpos / dtime += dS summed into their buckets; dS = SiLU'(scores) * mask * (norm * dout) v^T. With
// zero_unseen, dq rows that see no key are zeroed and so are each sequence's dk and dv rows before its
// first chunk adds to them (dq, dk, dv may then be uninitialised when the call's chunks hold every row).
// saved: forward_chunks' kept tiles of the same call, read instead of computing the scores again.
void backward_chunks(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& grad_out, const Tensor& dq,
                     const Tensor& dk, const Tensor& dv, const std::optional<Tensor>& pos_w,
                     const std::optional<Tensor>& time_w, const std::optional<Tensor>& dpos,
                     const std::optional<Tensor>& dtime, const std::optional<Tensor>& saved, double alpha,
                     bool zero_unseen, at::TensorList starts, at::TensorList lengths, IntArrayRef group,
                     IntArrayRef rows, IntArrayRef m0, IntArrayRef lo, IntArrayRef hi,
                     const c10::List<std::optional<Tensor>>& row_pos, const c10::List<std::optional<Tensor>>& time_idx,
                     const c10::List<std::optional<Tensor>>& mask, IntArrayRef mask_from,
                     const c10::List<std::optional<Tensor>>& row_end, at::TensorList norm, bool bf16) {
  const gr_gemm::Gemm gemm = gr_gemm::gemm_for(bf16);
  const Jagged Q(q), Kt(k), V(v), dO(grad_out), dQ(dq), dK(dk), dV(dv);
  const int64_t H = Q.heads, D = q.size(2), Dv = v.size(2);
  const Call call =
      ChunkArgs{starts, lengths, group, rows, m0, lo, hi, mask_from, row_pos, time_idx, mask, row_end, norm}.make(
          pos_w, time_w);
  const int64_t K = call.K;
  const int64_t P = dpos.has_value() ? dpos->numel() : 0, NB = dtime.has_value() ? dtime->numel() : 0;
  const float a = static_cast<float>(alpha);
  const float* kept = nullptr;
  if (saved.has_value()) {
    TORCH_CHECK(saved->scalar_type() == at::kFloat && saved->is_contiguous() &&
                    saved->numel() == saved_tile_floats(call, H),
                "cpu_fused: saved must be forward_chunks' contiguous fp32 tiles of the same chunks, ",
                saved_tile_floats(call, H), " floats");
    kept = saved->data_ptr<float>();
  }
  gr_parallel::SlotSums bias_grads(call.slots.count, P + kTimeParts * NB);  // [dpos | dtime's parts]
  for_each_item(
      call, H,
      [&] {
        const int64_t shared = H > 1 ? kSharedBias : 0;
        return gr_blas::aligned_floats(ROW_BLOCK * K, ROW_BLOCK * K, ROW_BLOCK * Dv, D * K, Dv * K, shared, shared);
      },
      [&](auto& scratch, int64_t slot, const Chunk& c, int64_t g, int64_t h, bool first_chunk, Place place) {
        float* scores = std::get<0>(scratch).data();
        float* weights = std::get<1>(scratch).data();
        float* g_rows = std::get<2>(scratch).data();
        float* kt = std::get<3>(scratch).data();
        float* vt = std::get<4>(scratch).data();
        // Shared by the sequence's heads (packed, m x n per block): its bias, made by the first head when
        // backward computes the scores again, and dS summed over the heads, whose bias gradients the last
        // head adds up.
        const bool share = shares_bias(H, place.item_scores);
        float* shared_bias = share && kept == nullptr && c.has_bias() ? std::get<5>(scratch).data() + place.within : nullptr;
        float* shared_ds = share && (P > 0 || NB > 0) ? std::get<6>(scratch).data() + place.within : nullptr;
        int64_t tiles = place.tiles;
        float* dpos_local = P > 0 ? bias_grads.slot(slot) : nullptr;
        float* dtime_local = NB > 0 ? bias_grads.slot(slot) + P : nullptr;
        const int64_t first = c.starts[g];
        const int64_t nrows = c.rows_of(g), nkeys = c.keys_of(g);
        const float* kp = Kt.rows(first + c.lo, h);
        if (zero_unseen && first_chunk) {
          zero_rows(dK.rows(first, h), c.lengths[g], D, dK.ld);
          zero_rows(dV.rows(first, h), c.lengths[g], Dv, dV.ld);
        }
        if (nrows > 0) {
          if (kept == nullptr) gr_gemm::transpose(nkeys, D, kp, Kt.ld, kt, K);
          gr_gemm::transpose(nkeys, Dv, V.rows(first + c.lo, h), V.ld, vt, K);
        }
        for (int64_t r0 = 0; r0 < nrows; r0 += ROW_BLOCK) {
          const int64_t r1 = std::min(r0 + ROW_BLOCK, nrows), m = r1 - r0;
          const int64_t n = c.keys_seen(g, r0, r1, nkeys);
          if (n == 0) {
            if (zero_unseen) zero_rows(dQ.rows(first + c.m0 + r0, h), m, D, dQ.ld);
            continue;
          }
          const float* qp = Q.rows(first + c.m0 + r0, h);
          // SiLU'(scores) and the weights, rows ld apart: kept by forward (packed, m x n), or made here.
          const int64_t ld = kept != nullptr ? n : K;
          const float* silu_grads = kept != nullptr ? kept + tiles + m * n : scores;
          const float* w = kept != nullptr ? kept + tiles : weights;
          float* bias = next_tile(shared_bias, m, n);
          if (bias != nullptr && h == 0) c.bias_rows(g, r0, r1, n, bias);
          float* ds_sum = next_tile(shared_ds, m, n);
          if (kept != nullptr)
            tiles += 2 * m * n;
          else
            scores_and_weights<true>(gemm, c, g, r0, r1, n, a, qp, Q.ld, kt, K, D, scores, weights, ld, bias);
          const float* dop = dO.rows(first + c.m0 + r0, h);
          for (int64_t i = r0; i < r1; ++i) {
            const float f = c.norm_of(g, i);
            for (int64_t j = 0; j < Dv; ++j) g_rows[(i - r0) * Dv + j] = dop[(i - r0) * dO.ld + j] * f;
          }
          gemm(true, false, n, Dv, m, 1.0f, w, ld, g_rows, Dv, 1.0f, dV.rows(first + c.lo, h), dV.ld);
          float* ds = weights;  // dweights, then dscores (over the weights once dV has them)
          gemm(false, false, m, n, Dv, 1.0f, g_rows, Dv, vt, K, 0.0f, ds, ld);
          for (int64_t i = r0; i < r1; ++i) {
            float* __restrict d = ds + (i - r0) * ld;
            const float* __restrict silu_grad = silu_grads + (i - r0) * ld;
            c.apply_mask(g, i, d, n);
            for (int64_t j = 0; j < n; ++j) d[j] *= silu_grad[j];
            if (ds_sum == nullptr) {
              c.add_bias_grads(g, i, d, n, dpos_local, dtime_local, NB);
              continue;
            }
            float* __restrict sum = ds_sum + (i - r0) * n;
            if (h == 0)
              std::copy(d, d + n, sum);
            else
              for (int64_t j = 0; j < n; ++j) sum[j] += d[j];
            if (h == H - 1) c.add_bias_grads(g, i, sum, n, dpos_local, dtime_local, NB);
          }
          gemm(false, false, m, D, n, a, ds, ld, kp, Kt.ld, 0.0f, dQ.rows(first + c.m0 + r0, h), dQ.ld);
          gemm(true, false, n, D, m, a, ds, ld, qp, Q.ld, 1.0f, dK.rows(first + c.lo, h), dK.ld);
        }
      });
  std::vector<float> total(P + kTimeParts * NB, 0.0f);
  bias_grads.add_to(total.data());
  if (P > 0) {
    float* acc = dpos->data_ptr<float>();
    for (int64_t b = 0; b < P; ++b) acc[b] += total[b];
  }
  if (NB > 0) {
    float* acc = dtime->data_ptr<float>();
    for (int64_t part = 0; part < kTimeParts; ++part)
      for (int64_t b = 0; b < NB; ++b) acc[b] += total[P + part * NB + b];
  }
}

// Time bucket of the (query row, key column) pairs of a chunk that a query may see, in one pass: rows
// [m0, m1) of each sequence's query times against the keys [lo, hi) of its key times (both [G, Lp]
// int64) -> [G, m1 - m0, hi - lo], uint8 when there are at most 256 buckets (a quarter of the bytes
// every layer's tiles read twice), else int32. The bucket of |dt| is floor(ln(max(|dt|, 1)) / 0.301) (or
// floor(sqrt(..))) clamped to [0, NB - 1], corrected by one step against `thresholds` [NB + 1]
// (gr.hstu.kernels.attention.common.time_bucket_thresholds), so that it equals time_bucket() exactly. Pairs no
// query sees get bucket 0 instead (a valid index: the tiles read them and the mask zeroes their
// weight): keys after the query (index > its own and >= contextual_len) and rows or keys past the
// sequence's length (`lengths` [G] int64). At ML-1M's shapes that skips about half the logarithms.
Tensor time_buckets(const Tensor& query_times, const Tensor& key_times, const Tensor& lengths, int64_t m0, int64_t m1,
                    int64_t lo, int64_t hi, int64_t contextual_len, const Tensor& thresholds, bool sqrt_bucketing) {
  TORCH_CHECK(query_times.scalar_type() == at::kLong && key_times.scalar_type() == at::kLong &&
                  query_times.is_contiguous() && key_times.is_contiguous() && query_times.dim() == 2 &&
                  query_times.sizes() == key_times.sizes(),
              "cpu_fused: query and key times must be contiguous int64 [G, Lp]");
  TORCH_CHECK(lengths.scalar_type() == at::kLong && lengths.is_contiguous() && lengths.numel() == query_times.size(0),
              "cpu_fused: lengths must be contiguous int64 [G]");
  TORCH_CHECK(thresholds.scalar_type() == at::kFloat && thresholds.is_contiguous() && thresholds.numel() >= 2,
              "cpu_fused: thresholds must be contiguous fp32 [NB + 1]");
  const int64_t G = query_times.size(0), Lp = query_times.size(1), C = m1 - m0, K = hi - lo;
  const int32_t NB = static_cast<int32_t>(thresholds.numel() - 1);
  const bool bytes = NB <= 256;
  Tensor out = at::empty({G, C, K}, query_times.options().dtype(bytes ? at::kByte : at::kInt));
  const int64_t* qt = query_times.data_ptr<int64_t>();
  const int64_t* kt = key_times.data_ptr<int64_t>();
  const int64_t* len = lengths.data_ptr<int64_t>();
  const float* thr = thresholds.data_ptr<float>();
  const float inv_div = 1.0f / 0.301f;
  // Per row: |dt| and the estimate vectorise (the logarithm through libmvec); the correction needs two
  // gathers a value, so it runs only on runs of 16 values where an estimate is within kNearEdge of a
  // bucket edge. Elsewhere the estimate is exact: libmvec's and PyTorch's logf (and any sqrtf) are off by
  // a few ulp, < 1e-4 of a bucket for |dt| < 2^63, so both floor to the same bucket; |dt| = 1 gives an
  // exact 0 on both.
  constexpr float kNearEdge = 1e-3f;
  auto rows = [&](auto* o, int64_t begin, int64_t end) {
    std::vector<float> x(K), f(K);
    std::vector<int32_t> estimate(K);
    std::vector<uint8_t> near_edge(K);
    for (int64_t gi = begin; gi < end; ++gi) {
      const int64_t g = gi / C, i = gi % C, row = m0 + i;
      const int64_t seen = row < len[g] ? std::min(len[g], std::max(row + 1, contextual_len)) - lo : 0;
      const int64_t n = std::clamp<int64_t>(seen, 0, K);
      const int64_t tq = qt[g * Lp + row];
      const int64_t* keys = kt + g * Lp + lo;
      auto* buckets = o + gi * K;
      float* __restrict xs = x.data();
      float* __restrict fs = f.data();
      int32_t* __restrict es = estimate.data();
      uint8_t* __restrict near = near_edge.data();
      const float* __restrict edges = thr;
      for (int64_t j = 0; j < n; ++j) xs[j] = std::max(std::fabs(static_cast<float>(tq - keys[j])), 1.0f);
      if (sqrt_bucketing) {
        for (int64_t j = 0; j < n; ++j) fs[j] = std::sqrt(xs[j]);
      } else {
        for (int64_t j = 0; j < n; ++j) fs[j] = logf(xs[j]) * inv_div;
      }
      for (int64_t j = 0; j < n; ++j) {
        const float frac = fs[j] - std::floor(fs[j]);
        es[j] = std::min(std::max(static_cast<int32_t>(fs[j]), 0), NB - 1);
        near[j] = xs[j] != 1.0f && (frac < kNearEdge || frac > 1.0f - kNearEdge);
      }
      for (int64_t j0 = 0; j0 < n; j0 += 16) {
        const int64_t j1 = std::min(j0 + 16, n);
        uint8_t any_near = 0;
        for (int64_t j = j0; j < j1; ++j) any_near |= near[j];
        if (!any_near) continue;
        for (int64_t j = j0; j < j1; ++j) {
          int32_t b = es[j];
          b += (xs[j] >= edges[b + 1]) ? 1 : 0;
          b -= (xs[j] < edges[b]) ? 1 : 0;
          es[j] = std::min(std::max(b, 0), NB - 1);
        }
      }
      for (int64_t j = 0; j < n; ++j) buckets[j] = es[j];
      std::fill(buckets + n, buckets + K, 0);
    }
  };
  at::parallel_for(0, G * C, 16, [&](int64_t begin, int64_t end) {
    if (bytes)
      rows(out.data_ptr<uint8_t>(), begin, end);
    else
      rows(out.data_ptr<int32_t>(), begin, end);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(gr_cpu_fused, m) {
  m.def(
      "forward_chunks(Tensor q, Tensor k, Tensor v, Tensor(a!) out, Tensor? pos_w, Tensor? time_w, float alpha, "
      "bool zero_unseen, int save_limit, Tensor[] starts, Tensor[] lengths, int[] group, int[] rows, int[] m0, "
      "int[] lo, int[] hi, Tensor?[] row_pos, Tensor?[] time_idx, Tensor?[] mask, int[] mask_from, "
      "Tensor?[] row_end, Tensor[] norm, bool bf16=False) -> Tensor");
  m.def(
      "backward_chunks(Tensor q, Tensor k, Tensor v, Tensor grad_out, Tensor(a!) dq, Tensor(b!) dk, Tensor(c!) dv, "
      "Tensor? pos_w, Tensor? time_w, Tensor(d!)? dpos, Tensor(e!)? dtime, Tensor? saved, float alpha, "
      "bool zero_unseen, Tensor[] starts, Tensor[] lengths, int[] group, int[] rows, int[] m0, int[] lo, "
      "int[] hi, Tensor?[] row_pos, Tensor?[] time_idx, Tensor?[] mask, int[] mask_from, Tensor?[] row_end, "
      "Tensor[] norm, bool bf16=False) -> ()");
  m.def(
      "time_buckets(Tensor query_times, Tensor key_times, Tensor lengths, int m0, int m1, int lo, int hi, "
      "int contextual_len, Tensor thresholds, bool sqrt_bucketing) -> Tensor");
}

TORCH_LIBRARY_IMPL(gr_cpu_fused, CPU, m) {
  m.impl("forward_chunks", &forward_chunks);
  m.impl("backward_chunks", &backward_chunks);
  m.impl("time_buckets", &time_buckets);
}
