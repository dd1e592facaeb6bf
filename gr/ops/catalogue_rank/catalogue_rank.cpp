// Each evaluation target's rank among the whole catalogue, excluded items left out.
//
// catalogue_ranks, from a row of scores per target: rank(r) = #{i : s[i] > s[t]} + #{i < t : s[i] == s[t]}
// less the excluded items counted there (each once, however often it is listed), t = targets[r]: the
// place of t in a stable sort of (-score, id). One pass over the row, two branch-free loops (ids before
// t count s >= s[t], ids from t on count s > s[t]), instead of comparing, summing and gathering the
// whole [R, I] score matrix several times. The caller passes finite scores only: under -ffast-math a
// NaN would compare unpredictably.
// place_ranks, from one score vector every row shares, given as each item's place in its (-score, id)
// order: place[t] less the excluded items placed before t.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

namespace {

using at::Tensor;

int64_t count_at_least(const float* s, int64_t n, float bar) {
  int64_t count = 0;
  for (int64_t i = 0; i < n; ++i) count += s[i] >= bar;
  return count;
}

int64_t count_above(const float* s, int64_t n, float bar) {
  int64_t count = 0;
  for (int64_t i = 0; i < n; ++i) count += s[i] > bar;
  return count;
}

// Row r's exclusions, checked: targets [R] int64 in [0, I); exclude_offsets [R+1] int64, rising positions
// into exclude_items [E] int64 (row r's: [offsets[r], offsets[r+1]); offsets[0] may be above 0), ids in [0, I).
struct Rows {
  Tensor targets, offsets, excluded;
  const int64_t *t, *o, *e;

  Rows(const char* op, const Tensor& targets_, const Tensor& offsets_, const Tensor& excluded_, int64_t items)
      : targets(targets_.contiguous()), offsets(offsets_.contiguous()), excluded(excluded_.contiguous()) {
    TORCH_CHECK(targets.dim() == 1 && targets.scalar_type() == at::kLong, "gr_cpu_rank.", op, ": expected [R] int64 targets");
    TORCH_CHECK(offsets.dim() == 1 && offsets.size(0) == targets.size(0) + 1 && offsets.scalar_type() == at::kLong &&
                    excluded.scalar_type() == at::kLong,
                "gr_cpu_rank.", op, ": expected [R+1] int64 exclude_offsets and int64 exclude_items");
    t = targets.data_ptr<int64_t>();
    o = offsets.data_ptr<int64_t>();
    e = excluded.data_ptr<int64_t>();
    const int64_t rows = targets.size(0), listed = excluded.numel();
    for (int64_t r = 0; r < rows; ++r) {
      TORCH_CHECK(t[r] >= 0 && t[r] < items, "gr_cpu_rank.", op, ": target ", t[r], " outside [0, ", items, ")");
      TORCH_CHECK(o[r] >= 0 && o[r] <= o[r + 1] && o[r + 1] <= listed,
                  "gr_cpu_rank.", op, ": exclude_offsets must rise within [0, ", listed, "]");
    }
    for (int64_t j = o[0]; j < o[rows]; ++j) {
      TORCH_CHECK(e[j] >= 0 && e[j] < items, "gr_cpu_rank.", op, ": excluded item ", e[j], " outside [0, ", items, ")");
    }
  }

  // rank(r) for every row, in parallel: rank(r, less) is the row's count before exclusions, less(item)
  // whether an excluded item is counted there; each distinct excluded item is taken back once.
  template <typename Rank, typename Less>
  Tensor ranks(int64_t items, Rank rank, Less less) const {
    const int64_t rows = targets.size(0);
    Tensor out = at::empty({rows}, targets.options());
    int64_t* result = out.data_ptr<int64_t>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      std::vector<uint8_t> seen(items, 0);  // the excluded items already taken back for this row
      for (int64_t r = begin; r < end; ++r) {
        int64_t value = rank(r);
        for (int64_t j = o[r]; j < o[r + 1]; ++j) {
          if (seen[e[j]]) continue;
          seen[e[j]] = 1;
          value -= less(r, e[j]);
        }
        for (int64_t j = o[r]; j < o[r + 1]; ++j) seen[e[j]] = 0;
        result[r] = value;
      }
    });
    return out;
  }
};

// scores: [R, I] float32, finite -> [R] int64.
Tensor catalogue_ranks(const Tensor& scores, const Tensor& targets, const Tensor& exclude_offsets,
                       const Tensor& exclude_items) {
  TORCH_CHECK(scores.dim() == 2 && scores.scalar_type() == at::kFloat && scores.is_contiguous(),
              "gr_cpu_rank.catalogue_ranks: expected contiguous [R, I] float32 scores");
  const int64_t items = scores.size(1);
  TORCH_CHECK(targets.size(0) == scores.size(0), "gr_cpu_rank.catalogue_ranks: expected a target per row of scores");
  const Rows rows("catalogue_ranks", targets, exclude_offsets, exclude_items, items);
  const float* s = scores.data_ptr<float>();
  const int64_t* t = rows.t;
  return rows.ranks(
      items,
      [&](int64_t r) {
        const float* row = s + r * items;
        return count_at_least(row, t[r], row[t[r]]) + count_above(row + t[r], items - t[r], row[t[r]]);
      },
      [&](int64_t r, int64_t item) {
        const float* row = s + r * items;
        return row[item] > row[t[r]] || (row[item] == row[t[r]] && item < t[r]);
      });
}

// place: [I] int64, each item's 0-based position in the shared (-score, id) order -> [R] int64.
Tensor place_ranks(const Tensor& place, const Tensor& targets, const Tensor& exclude_offsets,
                   const Tensor& exclude_items) {
  TORCH_CHECK(place.dim() == 1 && place.scalar_type() == at::kLong, "gr_cpu_rank.place_ranks: expected [I] int64 place");
  const Tensor order = place.contiguous();
  const Rows rows("place_ranks", targets, exclude_offsets, exclude_items, order.size(0));
  const int64_t* p = order.data_ptr<int64_t>();
  const int64_t* t = rows.t;
  return rows.ranks(
      order.size(0), [&](int64_t r) { return p[t[r]]; }, [&](int64_t r, int64_t item) { return p[item] < p[t[r]]; });
}

}  // namespace

TORCH_LIBRARY(gr_cpu_rank, m) {
  m.def("catalogue_ranks(Tensor scores, Tensor targets, Tensor exclude_offsets, Tensor exclude_items) -> Tensor",
        &catalogue_ranks);
  m.def("place_ranks(Tensor place, Tensor targets, Tensor exclude_offsets, Tensor exclude_items) -> Tensor",
        &place_ranks);
}
