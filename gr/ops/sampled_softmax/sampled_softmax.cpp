// Sampled softmax with per-row negatives for CPU (fp32; the block GEMMs in bf16 math when asked), fused:
// gr.ops.sampled_softmax.sampled_softmax_loss.
//
// Each row scores only its own K + 1 items: one dot product per (row, item) read straight from the
// item table (with AVX-512 a copy with rows padded to whole vectors: Rows), which for catalogues of
// a few thousand items sits in the core's L2. That is the
// useful 1 / 30th of the dense path's [N, U] logit tiles (ML-1M: 129 of 3,706 items a row), and
// no [N, K + 1, d] gather is materialised. Backward scatters the items' gradient into one table
// per thread (kept only while U * d is small: see MAX_TABLE_ELEMENTS in losses.py) and sums them
// in thread order.
//
// When rows share draws of negatives (rows_per_draw = R > 1: the N rows are dealt to B = ceil(N / R)
// blocks in turn, row n to block n mod B), a block's K negative rows are gathered once into a panel
// and its scores are one GEMM ([~R, d] x [d, K], the block's rows B apart); backward is two GEMMs
// against the same panel, and the items' gradient is scattered once per block instead of once per
// row. At ML-1M's shapes a per-row dot product is bound by its gathered row (~16 cycles each).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "gr_blas.h"
#include "gr_gemm.h"
#include "gr_parallel.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

namespace {

using at::Tensor;

void check_inputs(const Tensor& queries, const Tensor& items, const Tensor& positive, const Tensor& negative,
                  int64_t rows_per_draw) {
  TORCH_CHECK(queries.dim() == 2 && items.dim() == 2 && queries.size(1) == items.size(1),
              "cpu_sampled_softmax: expected queries [N, d] and items [U, d]");
  TORCH_CHECK(queries.scalar_type() == at::kFloat && items.scalar_type() == at::kFloat && queries.is_contiguous() &&
                  items.is_contiguous(),
              "cpu_sampled_softmax: queries and items must be contiguous fp32");
  TORCH_CHECK(positive.dim() == 1 && positive.size(0) == queries.size(0) && positive.scalar_type() == at::kLong &&
                  positive.is_contiguous(),
              "cpu_sampled_softmax: positive must be contiguous int64 [N]");
  TORCH_CHECK(rows_per_draw >= 1, "cpu_sampled_softmax: rows_per_draw must be >= 1");
  TORCH_CHECK(negative.dim() == 2 && negative.size(0) == (queries.size(0) + rows_per_draw - 1) / rows_per_draw &&
                  negative.scalar_type() == at::kLong && negative.is_contiguous(),
              "cpu_sampled_softmax: negative must be contiguous int64 [ceil(N / rows_per_draw), K]");
}

// V for rows of d floats where the AVX-512 code has a specialisation, else 0.
int vectors_for(int64_t d) {
#if defined(__AVX512F__)
  const int64_t v = (d + 15) / 16;
  if (v <= 4 || v == 8) return static_cast<int>(v);
#endif
  return 0;
}

// The item rows the kernels gather, [U, ld] with ld >= d: with AVX-512 a copy whose rows are padded
// with zeros to whole vectors (ld = 16 V) and 64-byte aligned, so that every row load and table
// store is one unmasked access that splits no cache line. Rows of 50 floats straddle lines: at
// ML-1M's shapes (13.7k rows, 129 items each, 3,706 items) the padded copy, 28 % larger, took the
// forward from 6.9 to 5.7 ms and backward from 10.7 to 8.9 ms on 2 Zen 4 cores. Otherwise the
// table itself (ld = d).
struct Rows {
  const float* data;
  int vectors;  // V: 16-float vectors a row (0: the scalar code)
  int64_t ld;
  gr_blas::AlignedFloats padded;

  explicit Rows(const Tensor& items)
      : data(items.data_ptr<float>()),
        vectors(vectors_for(items.size(1))),
        ld(vectors ? 16 * vectors : items.size(1)),
        padded(vectors ? items.size(0) * ld : 0, true) {
    if (vectors == 0) return;
    const int64_t U = items.size(0), d = items.size(1);
    for (int64_t u = 0; u < U; ++u) std::memcpy(padded.data() + u * ld, data + u * d, d * sizeof(float));
    data = padded.data();
  }
};

#if defined(__AVX512F__)
// With AVX-512 a query row of d <= 16 * V floats lives in V registers (the last one masked), so a
// row's query (forward) and its gradient (backward) stay in registers across its K + 1 items; the
// item rows (and backward's tables) are Rows' padded copies, read and written whole.
template <int V>
struct Lanes {
  __mmask16 tail;
  explicit Lanes(int64_t d) : tail(static_cast<__mmask16>((1u << (d - 16 * (V - 1))) - 1u)) {}
  __mmask16 mask(int v) const { return v == V - 1 ? tail : static_cast<__mmask16>(0xFFFF); }
  void load(const float* x, __m512* out) const {
    for (int v = 0; v < V; ++v) out[v] = _mm512_maskz_loadu_ps(mask(v), x + 16 * v);
  }
  void store(const __m512* x, float* out) const {
    for (int v = 0; v < V; ++v) _mm512_mask_storeu_ps(out + 16 * v, mask(v), x[v]);
  }
  // q . row: the padded lanes of row are zero.
  static float dot(const __m512* q, const float* row) {
    __m512 acc = _mm512_mul_ps(q[0], _mm512_load_ps(row));
    for (int v = 1; v < V; ++v) acc = _mm512_fmadd_ps(q[v], _mm512_load_ps(row + 16 * v), acc);
    return _mm512_reduce_add_ps(acc);
  }
};

// [sum(v[0]), ..., sum(v[15])]: the horizontal sums of 16 vectors, by pairwise unpacks and lane
// shuffles (45 instructions), instead of 16 separate reductions whose latency chains dominate.
inline __m512 sum16(const __m512* v) {
  __m512 x[8], y[4];
  for (int i = 0; i < 8; ++i)
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(x[2 * i]), b = _mm512_castps_pd(x[2 * i + 1]);
    y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // y[i]'s 128-bit lane L holds lane L's sums of v[4i .. 4i + 3]; add the four lanes.
  const __m512 z0 = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88), _mm512_shuffle_f32x4(y[0], y[1], 0xDD));
  const __m512 z1 = _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], 0x88), _mm512_shuffle_f32x4(y[2], y[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, 0x88), _mm512_shuffle_f32x4(z0, z1, 0xDD));
}

template <int V>
void dot_rows(const float* q, const float* items, const int64_t* ids, int64_t n, int64_t d, float* out) {
  const Lanes<V> lanes(d);
  constexpr int64_t ld = 16 * V;
  __m512 qv[V], acc[16];
  lanes.load(q, qv);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    for (int k = 0; k < 16; ++k) {
      const float* row = items + ids[j + k] * ld;
      acc[k] = _mm512_mul_ps(qv[0], _mm512_load_ps(row));
      for (int v = 1; v < V; ++v) acc[k] = _mm512_fmadd_ps(qv[v], _mm512_load_ps(row + 16 * v), acc[k]);
    }
    _mm512_storeu_ps(out + j, sum16(acc));
  }
  for (; j < n; ++j) out[j] = Lanes<V>::dot(qv, items + ids[j] * ld);
}

// dq = sum_j w_j items[ids_j]; table[ids_j] += w_j q (the tables' padded lanes stay zero: q's are).
template <int V>
void scatter_row(const float* q, const float* items, const int64_t* ids, const float* w, int64_t n, int64_t d,
                 float* dq, float* table) {
  const Lanes<V> lanes(d);
  constexpr int64_t ld = 16 * V;
  __m512 qv[V], acc[V];
  lanes.load(q, qv);
  for (int v = 0; v < V; ++v) acc[v] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    if (w[j] == 0.0f) continue;  // masked negatives
    const __m512 wj = _mm512_set1_ps(w[j]);
    const float* row = items + ids[j] * ld;
    float* t = table + ids[j] * ld;
    for (int v = 0; v < V; ++v) {
      acc[v] = _mm512_fmadd_ps(wj, _mm512_load_ps(row + 16 * v), acc[v]);
      _mm512_store_ps(t + 16 * v, _mm512_fmadd_ps(wj, qv[v], _mm512_load_ps(t + 16 * v)));
    }
  }
  lanes.store(acc, dq);
}
#endif

// out[j] = q . rows[ids[j]] for j < n.
void dots(const float* q, const Rows& rows, const int64_t* ids, int64_t n, int64_t d, float* out) {
#if defined(__AVX512F__)
  switch (rows.vectors) {
    case 1: return dot_rows<1>(q, rows.data, ids, n, d, out);
    case 2: return dot_rows<2>(q, rows.data, ids, n, d, out);
    case 3: return dot_rows<3>(q, rows.data, ids, n, d, out);
    case 4: return dot_rows<4>(q, rows.data, ids, n, d, out);
    case 8: return dot_rows<8>(q, rows.data, ids, n, d, out);
    default: break;
  }
#endif
  for (int64_t j = 0; j < n; ++j) {
    const float* row = rows.data + ids[j] * rows.ld;
    float s = 0.0f;
    for (int64_t i = 0; i < d; ++i) s += q[i] * row[i];
    out[j] = s;
  }
}

// dq = sum_j w[j] rows[ids[j]] (written); table[ids[j]] += w[j] q, table rows of rows.ld floats.
void scatter(const float* q, const Rows& rows, const int64_t* ids, const float* w, int64_t n, int64_t d, float* dq,
             float* table) {
#if defined(__AVX512F__)
  switch (rows.vectors) {
    case 1: return scatter_row<1>(q, rows.data, ids, w, n, d, dq, table);
    case 2: return scatter_row<2>(q, rows.data, ids, w, n, d, dq, table);
    case 3: return scatter_row<3>(q, rows.data, ids, w, n, d, dq, table);
    case 4: return scatter_row<4>(q, rows.data, ids, w, n, d, dq, table);
    case 8: return scatter_row<8>(q, rows.data, ids, w, n, d, dq, table);
    default: break;
  }
#endif
  for (int64_t i = 0; i < d; ++i) dq[i] = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    if (w[j] == 0.0f) continue;
    const float* row = rows.data + ids[j] * rows.ld;
    float* acc = table + ids[j] * rows.ld;
    for (int64_t i = 0; i < d; ++i) {
      dq[i] += w[j] * row[i];
      acc[i] += w[j] * q[i];
    }
  }
}

// Row r's K + 1 item ids (its positive, then its negatives) into ids; false if one is outside [0, U).
bool row_ids(const int64_t* positive, const int64_t* negative, int64_t r, int64_t K, int64_t U, int64_t* ids) {
  ids[0] = positive[r];
  for (int64_t j = 0; j < K; ++j) ids[j + 1] = negative[r * K + j];
  bool ok = true;
  for (int64_t j = 0; j <= K; ++j) ok &= ids[j] >= 0 && ids[j] < U;
  return ok;
}

// Rows b, b + B, ..., < N of block b (of B) share the negatives ids[0, K): false if an id or a positive
// is outside [0, U).
bool block_ids_ok(const int64_t* positive, const int64_t* ids, int64_t b, int64_t B, int64_t N, int64_t K,
                  int64_t U) {
  bool ok = true;
  for (int64_t j = 0; j < K; ++j) ok &= ids[j] >= 0 && ids[j] < U;
  for (int64_t r = b; r < N; r += B) ok &= positive[r] >= 0 && positive[r] < U;
  return ok;
}

// The rows ids[0, K) of `rows`, whole (padded lanes included), into panel [K, rows.ld].
void gather_rows(const Rows& rows, const int64_t* ids, int64_t K, float* __restrict panel) {
  const int64_t ld = rows.ld;
  for (int64_t j = 0; j < K; ++j) {
    const float* __restrict row = rows.data + ids[j] * ld;
    for (int64_t i = 0; i < ld; ++i) panel[j * ld + i] = row[i];
  }
}

// w[j] = d(scale * (lse - logit_0)) / d logit_j = scale * (p_j - [j = 0]) for one row's K + 1 probabilities.
void logit_grads(const float* __restrict p, int64_t K1, float scale, float* __restrict w) {
  w[0] = (p[0] - 1.0f) * scale;
  for (int64_t j = 1; j < K1; ++j) w[j] = p[j] * scale;
}

// One row's K + 1 dot products (the positive's first) -> its probabilities, in place; returns its loss
// lse - logit_0. A negative equal to the positive (negatives[j - 1] == positive) is masked out: its
// logit becomes the lowest float (finite: the build assumes no infinities), whose exp is 0. One pass
// each for the mask, the max and the exp, so that each vectorises.
float softmax_row(float* __restrict logits, int64_t positive, const int64_t* __restrict negatives, int64_t K1,
                  float inv_t) {
  constexpr float kMasked = std::numeric_limits<float>::lowest();
  logits[0] *= inv_t;
  for (int64_t j = 1; j < K1; ++j) logits[j] = negatives[j - 1] == positive ? kMasked : logits[j] * inv_t;
  float top = logits[0];
  for (int64_t j = 1; j < K1; ++j) top = std::max(top, logits[j]);
  const float positive_logit = logits[0];
  float sum = 0.0f;
  for (int64_t j = 0; j < K1; ++j) {
    logits[j] = std::exp(logits[j] - top);
    sum += logits[j];
  }
  const float inv_sum = 1.0f / sum;
  for (int64_t j = 0; j < K1; ++j) logits[j] *= inv_sum;
  return top + std::log(sum) - positive_logit;
}

// -> (probs [N, K + 1] fp32, per-row loss [N] fp32); column 0 is each row's positive [N], columns 1..K
// its negatives (row r's are negative[r mod B], [B = ceil(N / rows_per_draw), K]), of which one equal
// to the positive is masked out. logits = dot / temperature.
std::tuple<Tensor, Tensor> forward(const Tensor& queries, const Tensor& items, const Tensor& positive,
                                   const Tensor& negative, int64_t rows_per_draw, double temperature, bool bf16) {
  const gr_gemm::Gemm gemm = gr_gemm::gemm_for(bf16);
  check_inputs(queries, items, positive, negative, rows_per_draw);
  const int64_t N = queries.size(0), K = negative.size(1), K1 = K + 1, d = queries.size(1), U = items.size(0);
  const int64_t R = rows_per_draw;
  Tensor probs = at::empty({N, K1}, queries.options());
  Tensor row_loss = at::empty({N}, queries.options());
  const float* q = queries.data_ptr<float>();
  const int64_t* pos = positive.data_ptr<int64_t>();
  const int64_t* neg = negative.data_ptr<int64_t>();
  const Rows rows(items);
  float* p = probs.data_ptr<float>();
  float* l = row_loss.data_ptr<float>();
  const float inv_t = static_cast<float>(1.0 / temperature);
  std::atomic<bool> out_of_range{false};
  if (R == 1) {
    at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
      std::vector<int64_t> ids(K1);
      for (int64_t r = begin; r < end; ++r) {
        if (!row_ids(pos, neg, r, K, U, ids.data())) {
          out_of_range = true;
          continue;
        }
        dots(q + r * d, rows, ids.data(), K1, d, p + r * K1);
        l[r] = softmax_row(p + r * K1, ids[0], ids.data() + 1, K1, inv_t);
      }
    });
  } else {
    // Blocks to whichever thread is free: nothing is summed across blocks here (backward sums per thread).
    const int64_t B = negative.size(0);
    gr_parallel::dynamic_for(B, [&] { return gr_blas::AlignedFloats(K * rows.ld); }, [&](auto& panel, int64_t b) {
      const int64_t m = (N - b + B - 1) / B;  // rows b, b + B, ...
      const int64_t* ids = neg + b * K;
      if (!block_ids_ok(pos, ids, b, B, N, K, U)) {
        out_of_range = true;
        return;
      }
      gather_rows(rows, ids, K, panel.data());
      gemm(false, true, m, K, d, 1.0f, q + b * d, B * d, panel.data(), rows.ld, 0.0f, p + b * K1 + 1, B * K1);
      for (int64_t r = b; r < N; r += B) {
        dots(q + r * d, rows, pos + r, 1, d, p + r * K1);
        l[r] = softmax_row(p + r * K1, pos[r], ids, K1, inv_t);
      }
    });
  }
  TORCH_CHECK(!out_of_range, "cpu_sampled_softmax: an index is outside [0, U)");
  return {probs, row_loss};
}

// Gradients of scale * sum(row_loss): -> (dqueries [N, d], ditems [U, d]), fp32.
std::tuple<Tensor, Tensor> backward(const Tensor& queries, const Tensor& items, const Tensor& positive,
                                    const Tensor& negative, int64_t rows_per_draw, const Tensor& probs, double scale,
                                    bool bf16) {
  const gr_gemm::Gemm gemm = gr_gemm::gemm_for(bf16);
  check_inputs(queries, items, positive, negative, rows_per_draw);
  const int64_t N = queries.size(0), K = negative.size(1), K1 = K + 1, d = queries.size(1), U = items.size(0);
  const int64_t R = rows_per_draw;
  TORCH_CHECK(probs.is_contiguous() && probs.size(0) == N && probs.size(1) == K1,
              "cpu_sampled_softmax: probs must be [N, K + 1]");
  Tensor dq = at::empty_like(queries);
  Tensor ditems = at::zeros_like(items);
  const float* q = queries.data_ptr<float>();
  const int64_t* pos = positive.data_ptr<int64_t>();
  const int64_t* neg = negative.data_ptr<int64_t>();
  const Rows rows(items);
  const float* p = probs.data_ptr<float>();
  float* dqp = dq.data_ptr<float>();
  const float s = static_cast<float>(scale);
  gr_parallel::SlotSums tables(at::get_num_threads(), U * rows.ld);  // each thread's share of ditems, rows as `rows`
  if (R == 1) {
    at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
      float* table = tables.slot(at::get_thread_num());
      std::vector<int64_t> ids(K1);
      std::vector<float> w(K1);
      for (int64_t r = begin; r < end; ++r) {
        TORCH_CHECK(row_ids(pos, neg, r, K, U, ids.data()), "cpu_sampled_softmax: an index is outside [0, U)");
        logit_grads(p + r * K1, K1, s, w.data());
        scatter(q + r * d, rows, ids.data(), w.data(), K1, d, dqp + r * d, table);
      }
    });
  } else {
    const int64_t B = negative.size(0);
    at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
      gr_blas::OneBlasThread one;
      float* table = tables.slot(at::get_thread_num());
      const int64_t ld = rows.ld;
      gr_blas::AlignedFloats panel(K * ld), dpanel(K * ld, true), w(R * K1);  // dpanel's padded lanes stay 0
      for (int64_t b = begin; b < end; ++b) {
        const int64_t m = (N - b + B - 1) / B;  // rows b, b + B, ...
        const int64_t* ids = neg + b * K;
        TORCH_CHECK(block_ids_ok(pos, ids, b, B, N, K, U), "cpu_sampled_softmax: an index is outside [0, U)");
        gather_rows(rows, ids, K, panel.data());
        for (int64_t i = 0; i < m; ++i) logit_grads(p + (b + i * B) * K1, K1, s, w.data() + i * K1);
        const float* wn = w.data() + 1;  // the negatives' weights [m, K], rows K1 apart
        gemm(false, false, m, d, K, 1.0f, wn, K1, panel.data(), ld, 0.0f, dqp + b * d, B * d);
        gemm(true, false, K, d, m, 1.0f, wn, K1, q + b * d, B * d, 0.0f, dpanel.data(), ld);
        for (int64_t i = 0; i < m; ++i) {
          const int64_t r = b + i * B;
          const float w0 = w.data()[i * K1];
          const float* item = rows.data + pos[r] * ld;
          float* t = table + pos[r] * ld;
          for (int64_t c = 0; c < d; ++c) {
            dqp[r * d + c] += w0 * item[c];
            t[c] += w0 * q[r * d + c];
          }
        }
        for (int64_t j = 0; j < K; ++j) {
          float* __restrict t = table + ids[j] * ld;
          const float* __restrict g = dpanel.data() + j * ld;
          for (int64_t i = 0; i < ld; ++i) t[i] += g[i];
        }
      }
    });
  }
  tables.add_rows_to(ditems.data_ptr<float>(), d, rows.ld);
  return {dq, ditems};
}

}  // namespace

TORCH_LIBRARY(gr_cpu_loss, m) {
  m.def(
      "sampled_softmax_forward(Tensor queries, Tensor items, Tensor positive, Tensor negative, int rows_per_draw, "
      "float temperature, bool bf16=False) -> (Tensor, Tensor)");
  m.def(
      "sampled_softmax_backward(Tensor queries, Tensor items, Tensor positive, Tensor negative, int rows_per_draw, "
      "Tensor probs, float scale, bool bf16=False) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(gr_cpu_loss, CPU, m) {
  m.impl("sampled_softmax_forward", &forward);
  m.impl("sampled_softmax_backward", &backward);
}
