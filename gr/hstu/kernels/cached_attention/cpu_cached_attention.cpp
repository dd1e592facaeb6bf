// HSTU cached attention for CPU (fp32). cached_forward: per request and head, the new tokens' rows
// against the request's cached keys and values, read row by row where they lie. cached_layer: one
// layer's whole call (gr.hstu.kernels.cached_attention.cpu), every request's new tokens' own term, its
// bias gathered from the layer's weights, cached_forward in-process, then the sum and the normaliser.
//
// A request's cached token j lies in row starts[j / block] + j % block of its pool ([H, rows, D]): a
// page pool read through the request's page table (block = the page size, starts = its pages' first
// rows), or a cache in its own tensor (one block from its first row). Either way the kernel makes a
// table of row pointers and runs the same GEMMs over it (gr_gemm::gemm_rows: each sum in an order set
// by the shapes alone), so the same K/V give the same bits wherever they lie: no gather copy of the
// cache, and no slower code for the unpaged one. Each (request, head) takes its new tokens kRowBlock at
// a time against kKeyBlock keys at a time: a block's keys are transposed once for all of its rows
// (one or two new tokens take dot products and a weighted sum instead), and its scores tile stays in
// this core's cache through bias, SiLU and mask to the second GEMM.
// Built and loaded by gr/ops/native.py; the PyTorch code runs when this cannot be built.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "gr_blas.h"
#include "gr_gemm.h"
#include "gr_parallel.h"
#include "gr_silu.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using at::IntArrayRef;
using at::Tensor;

constexpr int64_t kRowBlock = 64;   // new tokens per scores tile
constexpr int64_t kKeyBlock = 256;  // cached keys per scores tile (gr_gemm's kDepth: one pass of the second GEMM)
constexpr int64_t kDotRows = 2;     // at most this many new tokens: dot_rows and weigh_rows, else gemm_rows

// An fp32 [n or 1, C] tensor of per-(new token, cached key) terms (bias or mask), or none.
struct Rows {
  const float* data = nullptr;
  bool shared = false;  // one row for every new token
  Rows(const std::optional<Tensor>& t, int64_t n, int64_t C, const char* what, int64_t b) {
    if (!t.has_value()) return;
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(1) == C &&
                    (t->size(0) == n || t->size(0) == 1),
                "cpu_cached: request ", b, "'s ", what, " must be a contiguous fp32 [", n, " or 1, ", C, "] tensor");
    data = t->data_ptr<float>();
    shared = t->size(0) == 1;
  }
  const float* row(int64_t i, int64_t C) const { return data == nullptr ? nullptr : data + (shared ? 0 : i) * C; }
};

// scores[i * ld + j] = alpha * q_i . keys[j] for i < m (at most kDotRows), j < n: each key's D values
// against each new token in vector lanes, then a sum across the lanes. For a request's few new
// tokens, where transposing the keys for gemm_rows costs more than the products; the order of the
// sums is set by m, n and D alone.
void dot_rows(int64_t m, int64_t n, int64_t D, float alpha, const float* q, int64_t ldq, const float* const* keys,
              float* scores, int64_t ld) {
  int64_t j = 0;
#if defined(__AVX512F__)
  // One new token: 16 keys' lane sums at a time, added up across lanes by one 16 x 16 transpose.
  for (; m == 1 && j + 16 <= n; j += 16) {
    __m512 acc[16];
    for (int64_t i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      const __mmask16 lanes = gr_gemm::first_lanes(D - d0);
      const __m512 qv = _mm512_maskz_loadu_ps(lanes, q + d0);
      for (int64_t i = 0; i < 16; ++i)
        acc[i] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(lanes, keys[j + i] + d0), qv, acc[i]);
    }
    gr_gemm::transpose16(acc);  // acc[c] lane i: lane c of key i's sums
    for (int64_t width = 8; width >= 1; width /= 2)
      for (int64_t c = 0; c < width; ++c) acc[c] = _mm512_add_ps(acc[c], acc[c + width]);
    _mm512_storeu_ps(scores + j, _mm512_mul_ps(_mm512_set1_ps(alpha), acc[0]));
  }
#endif
  for (; j < n; ++j) {
    const float* k = keys[j];
#if defined(__AVX512F__)
    __m512 acc[kDotRows];
    for (int64_t r = 0; r < m; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      const __mmask16 lanes = gr_gemm::first_lanes(D - d0);
      const __m512 kv = _mm512_maskz_loadu_ps(lanes, k + d0);
      for (int64_t r = 0; r < m; ++r)
        acc[r] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(lanes, q + r * ldq + d0), kv, acc[r]);
    }
    for (int64_t r = 0; r < m; ++r) scores[r * ld + j] = alpha * _mm512_reduce_add_ps(acc[r]);
#else
    for (int64_t r = 0; r < m; ++r) {
      float sum = 0.0f;
      for (int64_t d = 0; d < D; ++d) sum += q[r * ldq + d] * k[d];
      scores[r * ld + j] = alpha * sum;
    }
#endif
  }
}

// out[i * ldo + c] = (accumulate ? out : 0) + sum_j w[i * ld + j] values[j][c] for i < m (at most
// kDotRows), j < n, c < Dl: per 16 columns, the keys in 4 interleaved partial sums (one would wait
// on the last FMA at every key), added pairwise at the end.
void weigh_rows(int64_t m, int64_t n, int64_t Dl, const float* w, int64_t ld, const float* const* values,
                bool accumulate, float* out, int64_t ldo) {
#if defined(__AVX512F__)
  constexpr int64_t kWays = 4;
  for (int64_t c0 = 0; c0 < Dl; c0 += 16) {
    const __mmask16 lanes = gr_gemm::first_lanes(Dl - c0);
    __m512 acc[kDotRows][kWays];
    for (int64_t r = 0; r < m; ++r)
      for (int64_t u = 0; u < kWays; ++u) acc[r][u] = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + kWays <= n; j += kWays)
      for (int64_t u = 0; u < kWays; ++u) {
        const __m512 x = _mm512_maskz_loadu_ps(lanes, values[j + u] + c0);
        for (int64_t r = 0; r < m; ++r) acc[r][u] = _mm512_fmadd_ps(_mm512_set1_ps(w[r * ld + j + u]), x, acc[r][u]);
      }
    for (; j < n; ++j) {
      const __m512 x = _mm512_maskz_loadu_ps(lanes, values[j] + c0);
      for (int64_t r = 0; r < m; ++r) acc[r][0] = _mm512_fmadd_ps(_mm512_set1_ps(w[r * ld + j]), x, acc[r][0]);
    }
    for (int64_t r = 0; r < m; ++r) {
      __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), _mm512_add_ps(acc[r][2], acc[r][3]));
      if (accumulate) sum = _mm512_add_ps(_mm512_maskz_loadu_ps(lanes, out + r * ldo + c0), sum);
      _mm512_mask_storeu_ps(out + r * ldo + c0, lanes, sum);
    }
  }
#else
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c = 0; c < Dl; ++c) {
      float sum = 0.0f;
      for (int64_t j = 0; j < n; ++j) sum += w[r * ld + j] * values[j][c];
      out[r * ldo + c] = accumulate ? out[r * ldo + c] + sum : sum;
    }
#endif
}

// out [N, H, Dl] = per request b and head h, rows [new_offsets[b], new_offsets[b + 1]):
// sum_j mask * SiLU(alpha q k_j + bias) v_j over its cache_lengths[b] cached keys j (k_j, v_j in
// pools_k / pools_v[pool_index[b]], row block_starts[block_offsets[b] + j / block] + j % block, the
// request's blocks of block = block_sizes[b] tokens from block_offsets[b] on); zero rows for a request
// without cached keys.
// bias, mask: per request an fp32 [n_b or 1, C_b] or None.
Tensor cached_forward(const Tensor& q, at::TensorList pools_k, at::TensorList pools_v, IntArrayRef new_offsets,
                      IntArrayRef cache_lengths, IntArrayRef pool_index, const Tensor& block_starts,
                      IntArrayRef block_offsets, IntArrayRef block_sizes, double alpha,
                      const c10::List<std::optional<Tensor>>& bias, const c10::List<std::optional<Tensor>>& mask) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.stride(2) == 1,
              "cpu_cached: q must be an fp32 [N, H, Da] tensor whose last dimension is contiguous");
  TORCH_CHECK(!pools_k.empty() && pools_k.size() == pools_v.size(), "cpu_cached: one V pool per K pool");
  TORCH_CHECK(block_starts.scalar_type() == at::kLong && block_starts.is_contiguous() && block_starts.dim() == 1,
              "cpu_cached: block_starts must be a contiguous int64 vector");
  const int64_t B = static_cast<int64_t>(cache_lengths.size()), N = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t Dl = pools_v[0].size(2);
  TORCH_CHECK(static_cast<int64_t>(new_offsets.size()) == B + 1 &&
                  static_cast<int64_t>(block_offsets.size()) == B + 1 &&
                  static_cast<int64_t>(pool_index.size()) == B && static_cast<int64_t>(block_sizes.size()) == B &&
                  bias.size() == static_cast<size_t>(B) && mask.size() == static_cast<size_t>(B),
              "cpu_cached: B requests need [B+1] offsets, [B] lengths, pool indices and block sizes, B biases and "
              "masks");
  for (size_t p = 0; p < pools_k.size(); ++p) {
    const Tensor &pk = pools_k[p], &pv = pools_v[p];
    TORCH_CHECK(pk.dim() == 3 && pv.dim() == 3 && pk.scalar_type() == at::kFloat && pv.scalar_type() == at::kFloat &&
                    pk.size(0) == H && pv.size(0) == H && pk.size(2) == D && pv.size(2) == Dl &&
                    pk.size(1) == pv.size(1) && pk.stride(2) == 1 && pv.stride(2) == 1,
                "cpu_cached: pool ", p, " must be fp32 K [", H, ", rows, ", D, "] and V [", H, ", rows, ", Dl,
                "] with contiguous rows");
  }
  const int64_t* news = new_offsets.data();
  const int64_t* lengths = cache_lengths.data();
  const int64_t* pools = pool_index.data();
  const int64_t* starts = block_starts.data_ptr<int64_t>();
  const int64_t* blocks = block_offsets.data();
  TORCH_CHECK(news[0] == 0 && news[B] == N, "cpu_cached: new_offsets must run from 0 to N");
  std::vector<Rows> biases, masks;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = news[b + 1] - news[b], C = lengths[b], block = block_sizes[b];
    TORCH_CHECK(block >= 1, "cpu_cached: request ", b, "'s blocks must hold at least one token");
    const int64_t used = (C + block - 1) / block;
    TORCH_CHECK(n >= 0 && C >= 0 && pools[b] >= 0 && pools[b] < static_cast<int64_t>(pools_k.size()) &&
                    blocks[b] >= 0 && blocks[b] + used <= block_starts.numel(),
                "cpu_cached: request ", b, " needs a pool index and one block start per ", block, " cached tokens");
    const int64_t rows = pools_k[pools[b]].size(1);
    for (int64_t s = blocks[b], j = 0; j < C; ++s, j += block)
      TORCH_CHECK(starts[s] >= 0 && starts[s] + std::min(block, C - j) <= rows, "cpu_cached: request ", b,
                  "'s block at row ", starts[s], " runs past its pool's ", rows, " rows");
    biases.emplace_back(bias.get(b), n, C, "bias", b);
    masks.emplace_back(mask.get(b), n, C, "mask", b);
  }
  Tensor out = at::empty({N, H, Dl}, q.options());
  float* o_data = out.data_ptr<float>();
  const float* q_data = q.data_ptr<float>();
  const int64_t ldq = q.stride(0), ldo = H * Dl;
  const float a = static_cast<float>(alpha);
  gr_parallel::dynamic_for(
      B * H,
      [] { return std::make_tuple(gr_blas::AlignedFloats(kRowBlock * kKeyBlock), std::vector<const float*>(),
                                  std::vector<const float*>()); },
      [&](auto& state, int64_t item) {
        const int64_t b = item / H, h = item % H;
        const int64_t n = news[b + 1] - news[b], C = lengths[b];
        float* o = o_data + news[b] * ldo + h * Dl;
        if (n == 0) return;
        if (C == 0) {
          for (int64_t i = 0; i < n; ++i) std::fill(o + i * ldo, o + i * ldo + Dl, 0.0f);
          return;
        }
        float* scores = std::get<0>(state).data();
        std::vector<const float*>& keys = std::get<1>(state);
        std::vector<const float*>& values = std::get<2>(state);
        const Tensor &pk = pools_k[pools[b]], &pv = pools_v[pools[b]];
        const float* k_head = pk.data_ptr<float>() + h * pk.stride(0);
        const float* v_head = pv.data_ptr<float>() + h * pv.stride(0);
        const int64_t k_ld = pk.stride(1), v_ld = pv.stride(1);
        keys.resize(C);
        values.resize(C);
        const int64_t block = block_sizes[b];
        for (int64_t s = blocks[b], j = 0; j < C; ++s)
          for (int64_t row = starts[s], end = j + std::min(block, C - j); j < end; ++j, ++row) {
            keys[j] = k_head + row * k_ld;
            values[j] = v_head + row * v_ld;
          }
        const float* q_rows = q_data + news[b] * ldq + h * q.stride(1);
        for (int64_t r0 = 0; r0 < n; r0 += kRowBlock) {
          const int64_t m = std::min(kRowBlock, n - r0);
          for (int64_t c0 = 0; c0 < C; c0 += kKeyBlock) {
            const int64_t nb = std::min(kKeyBlock, C - c0);
            if (m <= kDotRows)
              dot_rows(m, nb, D, a, q_rows + r0 * ldq, ldq, keys.data() + c0, scores, kKeyBlock);
            else
              gr_gemm::gemm_rows(true, m, nb, D, a, q_rows + r0 * ldq, ldq, keys.data() + c0, 0.0f, scores, kKeyBlock);
            for (int64_t i = 0; i < m; ++i) {
              float* __restrict s = scores + i * kKeyBlock;
              const float* __restrict add = biases[b].row(r0 + i, C);
              if (add != nullptr)
                for (int64_t j = 0; j < nb; ++j) s[j] += add[c0 + j];
              gr_silu::silu(s, s, nullptr, nb);
              const float* __restrict keep = masks[b].row(r0 + i, C);
              if (keep != nullptr)
                for (int64_t j = 0; j < nb; ++j) s[j] *= keep[c0 + j];
            }
            if (m <= kDotRows)
              weigh_rows(m, nb, Dl, scores, kKeyBlock, values.data() + c0, c0 > 0, o + r0 * ldo, ldo);
            else
              gr_gemm::gemm_rows(false, m, Dl, nb, 1.0f, scores, kKeyBlock, values.data() + c0, c0 == 0 ? 0.0f : 1.0f,
                                 o + r0 * ldo, ldo);
          }
        }
      });
  return out;
}

// A relative bias at one request's buckets: position_weights[position] + time_weights[time], in the
// weights' dtype and the buckets' shape (BiasBuckets.bias); none without weights (no RelativeBias).
std::optional<Tensor> bias_at(const std::optional<Tensor>& position_weights, const std::optional<Tensor>& time_weights,
                              const std::optional<Tensor>& position, const std::optional<Tensor>& time, int64_t b) {
  if (!position_weights.has_value() && !time_weights.has_value()) return std::nullopt;
  std::optional<Tensor> bias;
  for (const auto& [weights, buckets, what] : {std::make_tuple(&position_weights, &position, "position"),
                                               std::make_tuple(&time_weights, &time, "time")}) {
    if (!buckets->has_value()) continue;
    TORCH_CHECK(weights->has_value() && (*weights)->dim() == 1, "cpu_cached: request ", b, "'s ", what,
                " buckets need [buckets] ", what, " weights");
    const Tensor part = at::index_select(**weights, 0, (*buckets)->reshape(-1)).view((*buckets)->sizes());
    bias = bias.has_value() ? at::add(*bias, part) : part;
  }
  return bias;
}

// Columns [from, from + cols) of bias_at's bias as a contiguous fp32 [rows, cols] tensor, gathered by
// one loop where the weights are fp32 (a gather and at most one add per entry: bias_at's bits); else
// bias_at's, sliced. The buckets: [rows, K] int64 ([K] for one row: a [cols] tensor back).
std::optional<Tensor> bias_columns(const std::optional<Tensor>& position_weights,
                                   const std::optional<Tensor>& time_weights, const std::optional<Tensor>& position,
                                   const std::optional<Tensor>& time, int64_t from, int64_t cols, int64_t b) {
  if ((!position_weights.has_value() && !time_weights.has_value()) || (!position.has_value() && !time.has_value()))
    return std::nullopt;
  const Tensor& shape = position.has_value() ? *position : *time;
  const bool fp32 = (!position.has_value() || (position_weights.has_value() &&
                                               position_weights->scalar_type() == at::kFloat)) &&
                    (!time.has_value() || (time_weights.has_value() && time_weights->scalar_type() == at::kFloat));
  if (!fp32) {
    const Tensor bias = *bias_at(position_weights, time_weights, position, time, b);
    return bias.narrow(-1, from, cols).to(at::kFloat).contiguous();
  }
  const int64_t rows = shape.dim() == 2 ? shape.size(0) : 1, K = shape.size(-1);
  TORCH_CHECK(shape.dim() <= 2 && from >= 0 && from + cols <= K, "cpu_cached: request ", b, "'s buckets must be [",
              "n or 1, ", from + cols, "]");
  Tensor out = at::empty(shape.dim() == 2 ? std::vector<int64_t>{rows, cols} : std::vector<int64_t>{cols},
                         shape.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  bool first = true;  // the first part is written, the second added
  for (const auto& [weights, buckets, what] : {std::make_tuple(&position_weights, &position, "position"),
                                               std::make_tuple(&time_weights, &time, "time")}) {
    if (!buckets->has_value()) continue;
    const Tensor w = (*weights)->contiguous(), where = (*buckets)->contiguous();
    TORCH_CHECK(w.dim() == 1 && where.scalar_type() == at::kLong && where.sizes() == shape.sizes(),
                "cpu_cached: request ", b, "'s ", what, " buckets must be int64 of the bias's shape, over [buckets] ",
                what, " weights");
    const float* wd = w.data_ptr<float>();
    const int64_t* id = where.data_ptr<int64_t>();
    const int64_t count = w.numel();
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        const int64_t bucket = id[r * K + from + c];
        TORCH_CHECK(bucket >= 0 && bucket < count, "cpu_cached: request ", b, "'s ", what, " bucket ", bucket,
                    " is out of its ", count, " weights");
        o[r * cols + c] = first ? wd[bucket] : o[r * cols + c] + wd[bucket];
      }
    first = false;
  }
  return out;
}

// One layer's cached attention [N, H, Dl]: per request b (rows [new_offsets[b], new_offsets[b + 1]) of
// q, k [N, H, Da], v [N, H, Dl]), norm * (its new tokens' own part + cached_forward's cached part), the
// sums and their order those of gr.hstu.kernels.cached_attention.cpu's PyTorch composition. The new
// tokens' own part: targets, SiLU(qh . kh + self bias) vh, each token with itself; history, (SiLU(qh kh^T
// + bias of the new keys) * new_mask) vh. qh = alpha q, head-major. Per request (Tensor?[] of B):
// position, time: int64 buckets of its bias against the cache [n or 1, C] (targets) or the cache and
// itself [n or 1, C + n] (history); self_position, self_time: targets' [n] buckets against themselves;
// cache_mask: fp32 [n, C] or None; new_mask: fp32 [n, n]; norm: fp32 [n, 1, 1]. The weights: [P], [NB]
// or None. K/V pools and blocks: as cached_forward takes them.
Tensor cached_layer(const Tensor& q, const Tensor& k, const Tensor& v, at::TensorList pools_k, at::TensorList pools_v,
                    IntArrayRef new_offsets, IntArrayRef cache_lengths, IntArrayRef pool_index,
                    const Tensor& block_starts, IntArrayRef block_offsets, IntArrayRef block_sizes, double alpha,
                    bool targets, const std::optional<Tensor>& position_weights,
                    const std::optional<Tensor>& time_weights, const c10::List<std::optional<Tensor>>& position,
                    const c10::List<std::optional<Tensor>>& time, const c10::List<std::optional<Tensor>>& self_position,
                    const c10::List<std::optional<Tensor>>& self_time,
                    const c10::List<std::optional<Tensor>>& cache_mask, at::TensorList new_mask,
                    at::TensorList norm) {
  const size_t B = cache_lengths.size();
  TORCH_CHECK(new_offsets.size() == B + 1 && position.size() == B && time.size() == B && self_position.size() == B &&
                  self_time.size() == B && cache_mask.size() == B && new_mask.size() == B && norm.size() == B,
              "cpu_cached: B requests need [B+1] new_offsets and B buckets, masks and norms of each kind");
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.size(0) == q.size(0) && v.size(0) == q.size(0),
              "cpu_cached: q, k and v must be [N, H, D] of the same N new tokens");
  c10::List<std::optional<Tensor>> biases, masks;
  std::vector<Tensor> own_parts(B);  // each request's new tokens' own part [H, n, Dl]
  for (size_t b = 0; b < B; ++b) {
    const int64_t start = new_offsets[b], n = new_offsets[b + 1] - start, C = cache_lengths[b];
    const int64_t index = static_cast<int64_t>(b);
    masks.push_back(cache_mask.get(b));
    if (n == 0) {
      biases.push_back(std::nullopt);
      continue;
    }
    const std::optional<Tensor> pos = position.get(b), tim = time.get(b);
    biases.push_back(bias_columns(position_weights, time_weights, pos, tim, 0, C, index));  // the cache's keys
    const Tensor qh = at::mul(q.narrow(0, start, n).transpose(0, 1), alpha);  // [H, n, Da]
    const Tensor kh = k.narrow(0, start, n).transpose(0, 1), vh = v.narrow(0, start, n).transpose(0, 1);
    if (targets) {  // each candidate sees itself only: an elementwise term
      Tensor self_logits = at::sum(at::mul(qh, kh), -1);  // [H, n]
      const std::optional<Tensor> self_bias =
          bias_columns(position_weights, time_weights, self_position.get(b), self_time.get(b), 0, n, index);
      if (self_bias.has_value()) self_logits = at::add(self_logits, self_bias->to(self_logits.scalar_type()));
      own_parts[b] = at::mul(at::silu(self_logits).unsqueeze(-1), vh);
    } else {
      Tensor block = at::matmul(qh, kh.transpose(1, 2));  // [H, n, n]
      const std::optional<Tensor> bias = bias_columns(position_weights, time_weights, pos, tim, C, n, index);
      if (bias.has_value()) block = at::add(block, bias->to(block.scalar_type()));
      own_parts[b] = at::matmul(at::mul(at::silu(block), new_mask[b].to(block.scalar_type())), vh);
    }
  }
  Tensor out = cached_forward(q, pools_k, pools_v, new_offsets, cache_lengths, pool_index, block_starts,
                              block_offsets, block_sizes, alpha, biases, masks);  // the cached part [N, H, Dl]
  for (size_t b = 0; b < B; ++b) {
    const int64_t start = new_offsets[b], n = new_offsets[b + 1] - start;
    if (n > 0) out.narrow(0, start, n).add_(own_parts[b].transpose(0, 1)).mul_(norm[b].to(out.scalar_type()));
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(gr_cpu_cached, m) {
  m.def(
      "cached_forward(Tensor q, Tensor[] pools_k, Tensor[] pools_v, int[] new_offsets, int[] cache_lengths, "
      "int[] pool_index, Tensor block_starts, int[] block_offsets, int[] block_sizes, float alpha, Tensor?[] bias, "
      "Tensor?[] mask) -> Tensor");
  m.def(
      "cached_layer(Tensor q, Tensor k, Tensor v, Tensor[] pools_k, Tensor[] pools_v, int[] new_offsets, "
      "int[] cache_lengths, int[] pool_index, Tensor block_starts, int[] block_offsets, int[] block_sizes, "
      "float alpha, bool targets, Tensor? position_weights, Tensor? time_weights, Tensor?[] position, "
      "Tensor?[] time, Tensor?[] self_position, Tensor?[] self_time, Tensor?[] cache_mask, Tensor[] new_mask, "
      "Tensor[] norm) -> Tensor");
}

TORCH_LIBRARY_IMPL(gr_cpu_cached, CPU, m) {
  m.impl("cached_forward", &cached_forward);
  m.impl("cached_layer", &cached_layer);
}
