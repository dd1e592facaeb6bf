// Sampled softmax with per-row negatives for CPU (fp32), fused: gr.train.losses.sampled_softmax_loss.
//
// Each row scores only its own K + 1 items: one dot product per (row, item) read straight from the
// item table, which for catalogues of a few thousand items sits in the core's L2. That is the
// useful 1 / 30th of the dense path's [N, U] logit tiles (ML-1M: 129 of 3,706 items a row), and
// no [N, K + 1, d] gather is materialised. Backward scatters the items' gradient into one table
// per thread (kept only while U * d is small: see MAX_TABLE_ELEMENTS in losses.py) and sums them.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <mutex>
#include <tuple>
#include <vector>

namespace {

using at::Tensor;

void check_inputs(const Tensor& queries, const Tensor& items, const Tensor& positive, const Tensor& negative) {
  TORCH_CHECK(queries.dim() == 2 && items.dim() == 2 && queries.size(1) == items.size(1),
              "cpu_sampled_softmax: expected queries [N, d] and items [U, d]");
  TORCH_CHECK(queries.scalar_type() == at::kFloat && items.scalar_type() == at::kFloat && queries.is_contiguous() &&
                  items.is_contiguous(),
              "cpu_sampled_softmax: queries and items must be contiguous fp32");
  TORCH_CHECK(positive.dim() == 1 && positive.size(0) == queries.size(0) && positive.scalar_type() == at::kLong &&
                  positive.is_contiguous(),
              "cpu_sampled_softmax: positive must be contiguous int64 [N]");
  TORCH_CHECK(negative.dim() == 2 && negative.size(0) == queries.size(0) && negative.scalar_type() == at::kLong &&
                  negative.is_contiguous(),
              "cpu_sampled_softmax: negative must be contiguous int64 [N, K]");
}

// Item of column j of row r: the positive first, then the row's negatives.
struct Columns {
  const int64_t* positive;
  const int64_t* negative;
  int64_t K;
  int64_t operator()(int64_t r, int64_t j) const { return j == 0 ? positive[r] : negative[r * K + j - 1]; }
};

float dot(const float* a, const float* b, int64_t d) {
  float s = 0.0f;
  for (int64_t i = 0; i < d; ++i) s += a[i] * b[i];
  return s;
}

// -> (probs [N, K + 1] fp32, per-row loss [N] fp32); column 0 is each row's positive [N], columns 1..K
// its negatives [N, K], of which one equal to the positive is masked out. logits = dot / temperature.
std::tuple<Tensor, Tensor> forward(const Tensor& queries, const Tensor& items, const Tensor& positive,
                                   const Tensor& negative, double temperature) {
  check_inputs(queries, items, positive, negative);
  const int64_t N = queries.size(0), K1 = negative.size(1) + 1, d = queries.size(1), U = items.size(0);
  const Columns item_of{positive.data_ptr<int64_t>(), negative.data_ptr<int64_t>(), K1 - 1};
  Tensor probs = at::empty({N, K1}, queries.options());
  Tensor row_loss = at::empty({N}, queries.options());
  const float* q = queries.data_ptr<float>();
  const float* it = items.data_ptr<float>();
  float* p = probs.data_ptr<float>();
  float* l = row_loss.data_ptr<float>();
  const float inv_t = static_cast<float>(1.0 / temperature);
  bool out_of_range = false;
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* logits = p + r * K1;
      float top = -std::numeric_limits<float>::infinity();
      const int64_t own = item_of(r, 0);
      for (int64_t j = 0; j < K1; ++j) {
        const int64_t id = item_of(r, j);
        if (id < 0 || id >= U) {
          out_of_range = true;
          logits[j] = -std::numeric_limits<float>::infinity();
          continue;
        }
        logits[j] = (j > 0 && id == own) ? -std::numeric_limits<float>::infinity() : dot(q + r * d, it + id * d, d) * inv_t;
        top = std::max(top, logits[j]);
      }
      float sum = 0.0f;
      for (int64_t j = 0; j < K1; ++j) sum += std::exp(logits[j] - top);
      const float lse = top + std::log(sum);
      l[r] = lse - logits[0];
      for (int64_t j = 0; j < K1; ++j) logits[j] = std::exp(logits[j] - lse);
    }
  });
  TORCH_CHECK(!out_of_range, "cpu_sampled_softmax: an index is outside [0, U)");
  return {probs, row_loss};
}

// Gradients of scale * sum(row_loss): -> (dqueries [N, d], ditems [U, d]), fp32.
std::tuple<Tensor, Tensor> backward(const Tensor& queries, const Tensor& items, const Tensor& positive,
                                    const Tensor& negative, const Tensor& probs, double scale) {
  check_inputs(queries, items, positive, negative);
  const int64_t N = queries.size(0), K1 = negative.size(1) + 1, d = queries.size(1), U = items.size(0);
  const Columns item_of{positive.data_ptr<int64_t>(), negative.data_ptr<int64_t>(), K1 - 1};
  TORCH_CHECK(probs.is_contiguous() && probs.size(0) == N && probs.size(1) == K1,
              "cpu_sampled_softmax: probs must be [N, K + 1]");
  Tensor dq = at::empty_like(queries);
  Tensor ditems = at::zeros_like(items);
  const float* q = queries.data_ptr<float>();
  const float* it = items.data_ptr<float>();
  const float* p = probs.data_ptr<float>();
  float* dqp = dq.data_ptr<float>();
  const float s = static_cast<float>(scale);
  std::mutex merge;
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> table(U * d, 0.0f);  // this thread's share of ditems
    for (int64_t r = begin; r < end; ++r) {
      const float* qr = q + r * d;
      float* out = dqp + r * d;
      for (int64_t i = 0; i < d; ++i) out[i] = 0.0f;
      for (int64_t j = 0; j < K1; ++j) {
        const float w = (p[r * K1 + j] - (j == 0 ? 1.0f : 0.0f)) * s;  // d(lse - logit_0) / d logit_j
        if (w == 0.0f) continue;  // masked negatives
        const int64_t id = item_of(r, j);
        const float* row = it + id * d;
        float* acc = table.data() + id * d;
        for (int64_t i = 0; i < d; ++i) {
          out[i] += w * row[i];
          acc[i] += w * qr[i];
        }
      }
    }
    std::lock_guard<std::mutex> lock(merge);
    float* total = ditems.data_ptr<float>();
    for (int64_t i = 0; i < U * d; ++i) total[i] += table[i];
  });
  return {dq, ditems};
}

}  // namespace

TORCH_LIBRARY(gr_cpu_loss, m) {
  m.def(
      "sampled_softmax_forward(Tensor queries, Tensor items, Tensor positive, Tensor negative, float temperature) -> "
      "(Tensor, Tensor)");
  m.def(
      "sampled_softmax_backward(Tensor queries, Tensor items, Tensor positive, Tensor negative, Tensor probs, "
      "float scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(gr_cpu_loss, CPU, m) {
  m.impl("sampled_softmax_forward", &forward);
  m.impl("sampled_softmax_backward", &backward);
}
