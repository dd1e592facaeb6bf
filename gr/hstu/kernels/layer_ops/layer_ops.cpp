// The HSTU layer's steps around attention on CPU (fp32; GEMMs in bf16 math when asked), fused per block
// of rows: gr.hstu.kernels.layer_ops.
//
// * projection_forward / projection_backward: U, V, Q, K = split(SiLU(LN(x) W^T + b)). Per block of
//   kBlock rows the LayerNorm, the GEMM and the bias and SiLU run while the block is in the core's
//   cache; the unfused ops write and re-read [T, D] and [T, 4 * H * d] tensors between each step
//   (addmm first copies the bias into its output). Each part is written contiguous, for readers
//   that take whole rows. Backward recomputes LN(x) from its statistics and takes the four parts'
//   gradients separately, so their concatenation is never built.
// * output_forward / output_backward: out = x + (LN(a) * u [* keep * scale]) W^T + b, the layer's
//   output with its residual, per block the same way; backward recomputes the GEMM's input.
// * norm_forward / norm_backward: y = (LN(x) * weight + bias) [* u] [* keep * scale], HSTU's
//   LN(A V) * U and dropout. PyTorch's CPU LayerNorm backward is slow for short rows (its weight
//   gradient is a second pass over the whole tensor); here each row is read once each way.
// * input_forward / input_backward: y = (x * scale + table[rows]) [* keep * keep_scale], the stack's
//   input (scaled embeddings, learned positions, dropout) in one pass each way instead of ~5 [T, D]
//   passes and an index_add_; the same roundings as those ops (no contraction into FMAs), and the
//   table's gradient summed per element in token order, as index_add_ does: bitwise the same.
// Blocks of rows go to whichever thread is free (gr_parallel::dynamic_for), a slot of consecutive
// blocks at a time; weight and bias gradients are summed per slot, then added up in slot order, so
// they repeat bitwise on any thread count.
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
#include <optional>
#include <tuple>
#include <vector>

namespace {

using at::Tensor;

constexpr int64_t kBlock = 128;   // rows per block: the projection's [kBlock, P] tiles stay in L2
constexpr int64_t kMaxSlots = 32;  // slots of blocks, each with its own partial weight gradients

void check_vector(const Tensor& t, int64_t n, const char* name) {
  TORCH_CHECK(t.numel() == n && t.scalar_type() == at::kFloat && t.is_contiguous(), "gr_cpu_layer: ", name,
              " must be contiguous fp32 [", n, "]");
}

void check_rows(const Tensor& t, int64_t rows, int64_t cols, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == cols && t.scalar_type() == at::kFloat &&
                  t.stride(1) == 1,
              "gr_cpu_layer: ", name, " must be fp32 [", rows, ", ", cols, "] with unit column stride");
}

void check_contiguous_rows(const Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "gr_cpu_layer: ", name,
              " must be contiguous fp32 [T, D]");
}

// y = x^ * w + b [* u] [* keep * scale] for n rows of width D, x^ = (x - mean) * rstd from the rows'
// statistics. Specialised on the gate and the mask so that each compiles to straight vector code
// (D is short: a branch or a possible alias in the loop costs as much as the work).
template <bool kGate, bool kKeep>
void apply_norm_rows(int64_t n, int64_t D, const float* __restrict x, const float* __restrict w,
                     const float* __restrict b, const float* __restrict u, int64_t u_stride,
                     const uint8_t* __restrict keep, float scale, const float* __restrict mean,
                     const float* __restrict rstd, float* __restrict y) {
  for (int64_t r = 0; r < n; ++r) {
    const float* __restrict row = x + r * D;
    const float* __restrict gate = u + r * u_stride;
    const uint8_t* __restrict kept = keep + r * D;
    float* __restrict out = y + r * D;
    const float m = mean[r], inv = rstd[r];
    for (int64_t i = 0; i < D; ++i) {
      float v = (row[i] - m) * inv * w[i] + b[i];
      if constexpr (kGate) v *= gate[i];
      if constexpr (kKeep) v *= static_cast<float>(kept[i]) * scale;
      out[i] = v;
    }
  }
}

// apply_norm_rows after computing each row's statistics into mean and rstd (LayerNorm's biased variance).
template <bool kGate, bool kKeep>
void norm_rows(int64_t n, int64_t D, const float* __restrict x, const float* __restrict w, const float* __restrict b,
               const float* __restrict u, int64_t u_stride, const uint8_t* __restrict keep, float scale, float eps,
               float* __restrict y, float* __restrict mean, float* __restrict rstd) {
  for (int64_t r = 0; r < n; ++r) {
    const float* __restrict row = x + r * D;
    float sum = 0.0f;
    for (int64_t i = 0; i < D; ++i) sum += row[i];
    const float m = sum / D;
    float var = 0.0f;
    for (int64_t i = 0; i < D; ++i) var += (row[i] - m) * (row[i] - m);
    mean[r] = m;
    rstd[r] = 1.0f / std::sqrt(var / D + eps);
  }
  apply_norm_rows<kGate, kKeep>(n, D, x, w, b, u, u_stride, keep, scale, mean, rstd, y);
}

// The blocks of kBlock rows of [0, T), in at most kMaxSlots slots of consecutive blocks.
struct Slots {
  int64_t blocks, per_slot, count;
  explicit Slots(int64_t T)
      : blocks((T + kBlock - 1) / kBlock),
        per_slot(std::max<int64_t>(1, (blocks + kMaxSlots - 1) / kMaxSlots)),
        count((blocks + per_slot - 1) / per_slot) {}
};

// body(state, slot, r0, n) for the blocks [r0, r0 + n) of kBlock rows of [0, T), a slot of blocks at
// a time on whichever thread is free (gr_parallel::dynamic_for); each thread keeps one state from
// make_state() (its scratch) and runs its GEMMs on one BLAS thread.
template <typename MakeState, typename Body>
void for_each_block(int64_t T, const MakeState& make_state, const Body& body) {
  const Slots slots(T);
  gr_parallel::dynamic_for(slots.count, make_state, [&](auto& state, int64_t slot) {
    const int64_t last = std::min(slots.blocks, (slot + 1) * slots.per_slot);
    for (int64_t block = slot * slots.per_slot; block < last; ++block) {
      const int64_t r0 = block * kBlock;
      body(state, slot, r0, std::min(kBlock, T - r0));
    }
  });
}

// One aligned [kBlock, width] fp32 buffer per width, as a tuple.
template <typename... Widths>
auto block_scratch(Widths... widths) {
  return gr_blas::aligned_floats((kBlock * widths)...);
}

// A layer's weight and bias gradients: partials of [weight (w floats) | bias (b floats)] per slot of
// for_each_block(T), added up in slot order (gr_parallel.h).
struct LayerGrads {
  int64_t w, b;
  gr_parallel::SlotSums sums;
  LayerGrads(int64_t T, int64_t w_, int64_t b_) : w(w_), b(b_), sums(Slots(T).count, w_ + b_) {}
  float* weight(int64_t slot) const { return sums.slot(slot); }
  float* bias(int64_t slot) const { return sums.slot(slot) + w; }
  // -> (the weight gradient viewed as `shape`, the bias gradient [b]).
  std::tuple<Tensor, Tensor> total(at::IntArrayRef shape, const at::TensorOptions& options) const {
    Tensor flat = at::zeros({w + b}, options);
    sums.add_to(flat.data_ptr<float>());
    return {flat.narrow(0, 0, w).view(shape), flat.narrow(0, w, b)};
  }
};

// Backward of norm_rows over n rows: dx, du (with a gate), and the LayerNorm's weight and bias
// gradients added into dw and db.
template <bool kGate, bool kKeep>
void norm_rows_backward(int64_t n, int64_t D, const float* __restrict dy, const float* __restrict x,
                        const float* __restrict w, const float* __restrict b, const float* __restrict u,
                        int64_t u_stride, const uint8_t* __restrict keep, float scale, const float* __restrict mean,
                        const float* __restrict rstd, float* __restrict dx, float* __restrict du,
                        float* __restrict dw, float* __restrict db) {
  std::vector<float> dz_row(D), xhat_row(D);
  float* __restrict dz = dz_row.data();
  float* __restrict xhat = xhat_row.data();
  for (int64_t r = 0; r < n; ++r) {
    const float* __restrict row = x + r * D;
    const float* __restrict g = dy + r * D;
    const float* __restrict gate = u + r * u_stride;
    const uint8_t* __restrict kept = keep + r * D;
    float* __restrict dgate = du + r * D;
    const float m = mean[r], inv = rstd[r];
    float mean_dxhat = 0.0f, mean_dxhat_xhat = 0.0f;
    for (int64_t i = 0; i < D; ++i) {
      const float h = (row[i] - m) * inv;
      float d = g[i];
      if constexpr (kKeep) d *= static_cast<float>(kept[i]) * scale;
      if constexpr (kGate) {
        dgate[i] = d * (h * w[i] + b[i]);
        d *= gate[i];
      }
      xhat[i] = h;
      dz[i] = d;
      dw[i] += d * h;
      db[i] += d;
      mean_dxhat += d * w[i];
      mean_dxhat_xhat += d * w[i] * h;
    }
    mean_dxhat /= D;
    mean_dxhat_xhat /= D;
    float* __restrict out = dx + r * D;
    for (int64_t i = 0; i < D; ++i) out[i] = inv * (dz[i] * w[i] - mean_dxhat - xhat[i] * mean_dxhat_xhat);
  }
}

void check_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, const std::optional<Tensor>& u,
                const std::optional<Tensor>& keep) {
  check_contiguous_rows(x, "x");
  check_vector(weight, x.size(1), "the norm's weight");
  check_vector(bias, x.size(1), "the norm's bias");
  if (u) check_rows(*u, x.size(0), x.size(1), "u");
  if (keep)
    TORCH_CHECK(keep->scalar_type() == at::kByte && keep->is_contiguous() && keep->numel() == x.numel(),
                "gr_cpu_layer: keep must be a contiguous uint8 mask of x's size");
}

// -> (y [T, D] fp32, mean [T], rstd [T]).
std::tuple<Tensor, Tensor, Tensor> norm_forward(const Tensor& x, const Tensor& weight, const Tensor& bias,
                                                const std::optional<Tensor>& u, const std::optional<Tensor>& keep,
                                                double scale, double eps) {
  check_norm(x, weight, bias, u, keep);
  const int64_t T = x.size(0), D = x.size(1);
  Tensor y = at::empty({T, D}, x.options());
  Tensor mean = at::empty({T}, x.options());
  Tensor rstd = at::empty({T}, x.options());
  auto rows = !u ? (keep ? norm_rows<false, true> : norm_rows<false, false>)
                 : (keep ? norm_rows<true, true> : norm_rows<true, false>);
  const int64_t u_stride = u ? u->stride(0) : 0;
  for_each_block(T, [] { return 0; }, [&](int, int64_t, int64_t r0, int64_t n) {
    rows(n, D, x.data_ptr<float>() + r0 * D, weight.data_ptr<float>(), bias.data_ptr<float>(),
         u ? u->data_ptr<float>() + r0 * u_stride : nullptr, u_stride,
         keep ? keep->data_ptr<uint8_t>() + r0 * D : nullptr, static_cast<float>(scale), static_cast<float>(eps),
         y.data_ptr<float>() + r0 * D, mean.data_ptr<float>() + r0, rstd.data_ptr<float>() + r0);
  });
  return {y, mean, rstd};
}

// -> (dx [T, D], dweight [D], dbias [D], du [T, D] or an empty tensor without u), fp32.
std::tuple<Tensor, Tensor, Tensor, Tensor> norm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight,
                                                         const Tensor& bias, const std::optional<Tensor>& u,
                                                         const std::optional<Tensor>& keep, const Tensor& mean,
                                                         const Tensor& rstd, double scale) {
  check_norm(x, weight, bias, u, keep);
  check_contiguous_rows(dy, "dy");
  const int64_t T = x.size(0), D = x.size(1);
  TORCH_CHECK(dy.sizes() == x.sizes(), "gr_cpu_layer: dy must have x's shape");
  Tensor dx = at::empty({T, D}, x.options());
  Tensor du = u ? at::empty({T, D}, x.options()) : at::empty({0}, x.options());
  auto rows = !u ? (keep ? norm_rows_backward<false, true> : norm_rows_backward<false, false>)
                 : (keep ? norm_rows_backward<true, true> : norm_rows_backward<true, false>);
  const int64_t u_stride = u ? u->stride(0) : 0;
  LayerGrads grads(T, D, D);
  for_each_block(T, [] { return 0; }, [&](int, int64_t slot, int64_t r0, int64_t n) {
    rows(n, D, dy.data_ptr<float>() + r0 * D, x.data_ptr<float>() + r0 * D, weight.data_ptr<float>(),
         bias.data_ptr<float>(), u ? u->data_ptr<float>() + r0 * u_stride : nullptr, u_stride,
         keep ? keep->data_ptr<uint8_t>() + r0 * D : nullptr, static_cast<float>(scale), mean.data_ptr<float>() + r0,
         rstd.data_ptr<float>() + r0, dx.data_ptr<float>() + r0 * D, u ? du.data_ptr<float>() + r0 * D : nullptr,
         grads.weight(slot), grads.bias(slot));
  });
  auto [dweight, dbias] = grads.total({D}, x.options());
  return {dx, dweight, dbias, du};
}

void check_projection(const Tensor& x, const Tensor& norm_weight, const Tensor& norm_bias, const Tensor& weight) {
  check_contiguous_rows(x, "x");
  const int64_t D = x.size(1);
  check_vector(norm_weight, D, "the norm's weight");
  check_vector(norm_bias, D, "the norm's bias");
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == D && weight.scalar_type() == at::kFloat && weight.is_contiguous(),
              "gr_cpu_layer: the projection's weight must be contiguous fp32 [P, ", D, "]");
}

// Column offsets of the parts of widths `sizes` in the projection's P output columns.
std::vector<int64_t> part_offsets(at::IntArrayRef sizes, int64_t P) {
  std::vector<int64_t> offsets;
  int64_t offset = 0;
  for (const int64_t w : sizes) {
    TORCH_CHECK(w >= 0, "gr_cpu_layer: a part's width must be >= 0, got ", w);
    offsets.push_back(offset);
    offset += w;
  }
  TORCH_CHECK(offset == P, "gr_cpu_layer: the parts are ", offset, " wide, the projection ", P);
  return offsets;
}

// The parts [T, sizes[i]] of one [T * P] buffer, each contiguous: part i at T * offsets[i].
std::vector<Tensor> part_views(const Tensor& buffer, int64_t T, at::IntArrayRef sizes,
                               const std::vector<int64_t>& offsets) {
  std::vector<Tensor> parts;
  for (size_t i = 0; i < sizes.size(); ++i)
    parts.push_back(buffer.narrow(0, T * offsets[i], T * sizes[i]).view({T, sizes[i]}));
  return parts;
}

// x [T, D] -> (parts [T, sizes[i]] of y = SiLU(pre), SiLU'(pre) in the same parts (none unless
// keep_grad), mean [T], rstd [T]), with pre = LN(x) W^T + b; W: weight [P, D], P = sum sizes. Each
// part is contiguous (its consumers, attention's q, k, v and the output's gate u, read whole rows
// instead of a quarter of each [P] row). Backward multiplies by the kept SiLU', made from the same exp.
std::tuple<std::vector<Tensor>, std::vector<Tensor>, Tensor, Tensor> projection_forward(
    const Tensor& x, const Tensor& norm_weight, const Tensor& norm_bias, double eps, const Tensor& weight,
    const Tensor& bias, at::IntArrayRef sizes, bool keep_grad, bool bf16) {
  const gr_gemm::Gemm gemm = gr_gemm::gemm_for(bf16);
  check_projection(x, norm_weight, norm_bias, weight);
  check_vector(bias, weight.size(0), "the projection's bias");
  const int64_t T = x.size(0), D = x.size(1), P = weight.size(0);
  const std::vector<int64_t> offsets = part_offsets(sizes, P);
  Tensor y = at::empty({T * P}, x.options());
  Tensor silu_grad = at::empty({keep_grad ? T * P : 0}, x.options());
  Tensor mean = at::empty({T}, x.options());
  Tensor rstd = at::empty({T}, x.options());
  const float* b = bias.data_ptr<float>();
  gr_blas::AlignedFloats wt(D * P);  // W^T [D, P]: the GEMM reads its B operand in rows
  gr_gemm::transpose(P, D, weight.data_ptr<float>(), D, wt.data(), P);
  // Per block: LN(x), transposed once for the parts' GEMMs (gr_gemm reads a transposed A's columns in
  // place, where it would pack a row-major one in each GEMM). Per part: the GEMM writes the part's
  // rows, which are contiguous, then SiLU runs over them in one vector loop; SiLU' goes to scratch,
  // then past the cache to its rows.
  for_each_block(T, [&] { return block_scratch(D, D, P); }, [&](auto& state, int64_t, int64_t r0, int64_t n) {
    auto& [normed, normed_t, grads] = state;
    norm_rows<false, false>(n, D, x.data_ptr<float>() + r0 * D, norm_weight.data_ptr<float>(),
                            norm_bias.data_ptr<float>(), nullptr, 0, nullptr, 1.0f, static_cast<float>(eps),
                            normed.data(), mean.data_ptr<float>() + r0, rstd.data_ptr<float>() + r0);
    gr_gemm::transpose(n, D, normed.data(), D, normed_t.data(), n);
    for (size_t part = 0; part < sizes.size(); ++part) {
      const int64_t w = sizes[part], first = offsets[part];
      float* __restrict out = y.data_ptr<float>() + T * first + r0 * w;
      float* __restrict grad = grads.data();
      const float* __restrict bp = b + first;
      gemm(true, false, n, w, D, 1.0f, normed_t.data(), n, wt.data() + first, P, 0.0f, out, w);
      for (int64_t r = 0; r < n; ++r)
        for (int64_t j = 0; j < w; ++j) out[r * w + j] += bp[j];
      gr_silu::silu(out, out, keep_grad ? grad : nullptr, n * w);
      if (keep_grad) gr_stream::store_for_backward(silu_grad.data_ptr<float>() + T * first + r0 * w, grad, n * w);
    }
  });
  std::vector<Tensor> silu_grads = keep_grad ? part_views(silu_grad, T, sizes, offsets) : std::vector<Tensor>{};
  return {part_views(y, T, sizes, offsets), silu_grads, mean, rstd};
}

// grads: the gradients of y's parts [T, n_i] (sum n_i = P, unit column stride), in order; silu_grads:
// projection_forward's SiLU' parts -> (dx [T, D], dnorm_weight [D], dnorm_bias [D], dweight [P, D], dbias [P]).
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> projection_backward(at::TensorList grads, const Tensor& x,
                                                                       const Tensor& norm_weight,
                                                                       const Tensor& norm_bias, const Tensor& weight,
                                                                       at::TensorList silu_grads, const Tensor& mean,
                                                                       const Tensor& rstd, bool bf16) {
  const gr_gemm::Gemm gemm = gr_gemm::gemm_for(bf16);
  check_projection(x, norm_weight, norm_bias, weight);
  const int64_t T = x.size(0), D = x.size(1), P = weight.size(0);
  TORCH_CHECK(grads.size() == silu_grads.size(), "gr_cpu_layer: ", grads.size(), " parts' gradients for ",
              silu_grads.size(), " SiLU' parts");
  int64_t width = 0;
  for (size_t part = 0; part < grads.size(); ++part) {
    const int64_t w = silu_grads[part].size(-1);
    check_contiguous_rows(silu_grads[part], "each SiLU' part");
    check_rows(silu_grads[part], T, w, "each SiLU' part");
    check_rows(grads[part], T, w, "each part's gradient");
    width += w;
  }
  TORCH_CHECK(width == P, "gr_cpu_layer: the parts' gradients are ", width, " wide, the projection ", P);
  Tensor dx = at::empty({T, D}, x.options());
  const float* nw = norm_weight.data_ptr<float>();
  const float* nb = norm_bias.data_ptr<float>();
  LayerGrads linear(T, P * D, P), norm(T, D, D);
  const auto scratch = [&] { return block_scratch(P, D, D); };
  for_each_block(T, scratch, [&](auto& state, int64_t slot, int64_t r0, int64_t n) {
    auto& [dpre, normed, dnormed] = state;
    int64_t offset = 0;
    for (size_t part = 0; part < grads.size(); ++part) {  // dpre = dy * SiLU'(pre), part by part
      const Tensor& g = grads[part];
      const int64_t w = g.size(1);
      for (int64_t r = 0; r < n; ++r) {
        const float* __restrict gr = g.data_ptr<float>() + (r0 + r) * g.stride(0);
        const float* __restrict sg = silu_grads[part].data_ptr<float>() + (r0 + r) * w;
        float* __restrict d = dpre.data() + r * P + offset;
        for (int64_t j = 0; j < w; ++j) d[j] = gr[j] * sg[j];
      }
      offset += w;
    }
    float* __restrict db = linear.bias(slot);
    for (int64_t r = 0; r < n; ++r)
      for (int64_t j = 0; j < P; ++j) db[j] += dpre.data()[r * P + j];
    const float* xr = x.data_ptr<float>() + r0 * D;
    const float* m = mean.data_ptr<float>() + r0;
    const float* s = rstd.data_ptr<float>() + r0;
    apply_norm_rows<false, false>(n, D, xr, nw, nb, nullptr, 0, nullptr, 1.0f, m, s, normed.data());  // LN(x) again
    gemm(true, false, P, D, n, 1.0f, dpre.data(), P, normed.data(), D, 1.0f, linear.weight(slot), D);
    gemm(false, false, n, D, P, 1.0f, dpre.data(), P, weight.data_ptr<float>(), D, 0.0f, dnormed.data(), D);
    norm_rows_backward<false, false>(n, D, dnormed.data(), xr, nw, nb, nullptr, 0, nullptr, 1.0f, m, s,
                                     dx.data_ptr<float>() + r0 * D, nullptr, norm.weight(slot), norm.bias(slot));
  });
  auto [dweight, dbias] = linear.total({P, D}, x.options());
  auto [dnorm_weight, dnorm_bias] = norm.total({D}, x.options());
  return {dx, dnorm_weight, dnorm_bias, dweight, dbias};
}

// The layer's output: out = x + (LN(a) * u [* keep * scale]) W^T + b, W: weight [D, A], per block of rows.
// a [T, A] contiguous, u [T, A] (unit column stride), x [T, D] contiguous -> (out [T, D], mean [T], rstd [T]).
std::tuple<Tensor, Tensor, Tensor> output_forward(const Tensor& a, const Tensor& u, const std::optional<Tensor>& keep,
                                                  double scale, const Tensor& norm_weight, const Tensor& norm_bias,
                                                  double eps, const Tensor& weight, const Tensor& bias,
                                                  const Tensor& x, bool bf16) {
  const gr_gemm::Gemm gemm = gr_gemm::gemm_for(bf16);
  check_norm(a, norm_weight, norm_bias, u, keep);
  const int64_t T = a.size(0), A = a.size(1), D = weight.size(0);
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == A && weight.scalar_type() == at::kFloat && weight.is_contiguous(),
              "gr_cpu_layer: the output weight must be contiguous fp32 [D, ", A, "]");
  check_vector(bias, D, "the output bias");
  check_contiguous_rows(x, "x");
  TORCH_CHECK(x.size(0) == T && x.size(1) == D, "gr_cpu_layer: x must be [T, D]");
  Tensor out = at::empty({T, D}, x.options());
  Tensor mean = at::empty({T}, x.options());
  Tensor rstd = at::empty({T}, x.options());
  auto rows = keep ? norm_rows<true, true> : norm_rows<true, false>;
  const float* b = bias.data_ptr<float>();
  gr_blas::AlignedFloats wt(A * D);  // W^T [A, D]
  gr_gemm::transpose(D, A, weight.data_ptr<float>(), A, wt.data(), D);
  for_each_block(T, [&] { return block_scratch(A, D); }, [&](auto& state, int64_t, int64_t r0, int64_t n) {
    auto& [mixed, tile] = state;
    rows(n, A, a.data_ptr<float>() + r0 * A, norm_weight.data_ptr<float>(), norm_bias.data_ptr<float>(),
         u.data_ptr<float>() + r0 * u.stride(0), u.stride(0), keep ? keep->data_ptr<uint8_t>() + r0 * A : nullptr,
         static_cast<float>(scale), static_cast<float>(eps), mixed.data(), mean.data_ptr<float>() + r0,
         rstd.data_ptr<float>() + r0);
    gemm(false, false, n, D, A, 1.0f, mixed.data(), A, wt.data(), D, 0.0f, tile.data(), D);
    for (int64_t r = 0; r < n; ++r) {
      const float* __restrict t = tile.data() + r * D;
      const float* __restrict residual = x.data_ptr<float>() + (r0 + r) * D;
      float* __restrict o = out.data_ptr<float>() + (r0 + r) * D;
      for (int64_t j = 0; j < D; ++j) o[j] = residual[j] + t[j] + b[j];
    }
  });
  return {out, mean, rstd};
}

// -> (da [T, A], du [T, A], dnorm_weight [A], dnorm_bias [A], dweight [D, A], dbias [D]); d x is dout itself.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> output_backward(
    const Tensor& dout, const Tensor& a, const Tensor& u, const std::optional<Tensor>& keep, double scale,
    const Tensor& norm_weight, const Tensor& norm_bias, const Tensor& weight, const Tensor& mean, const Tensor& rstd,
    bool bf16) {
  const gr_gemm::Gemm gemm = gr_gemm::gemm_for(bf16);
  check_norm(a, norm_weight, norm_bias, u, keep);
  check_contiguous_rows(dout, "dout");
  const int64_t T = a.size(0), A = a.size(1), D = weight.size(0);
  TORCH_CHECK(dout.size(0) == T && dout.size(1) == D, "gr_cpu_layer: dout must be [T, D]");
  Tensor da = at::empty({T, A}, a.options());
  Tensor du = at::empty({T, A}, a.options());
  auto rows = keep ? apply_norm_rows<true, true> : apply_norm_rows<true, false>;
  auto rows_backward = keep ? norm_rows_backward<true, true> : norm_rows_backward<true, false>;
  const float* nw = norm_weight.data_ptr<float>();
  const float* nb = norm_bias.data_ptr<float>();
  LayerGrads linear(T, D * A, D), norm(T, A, A);
  const auto scratch = [&] { return block_scratch(A, A); };
  for_each_block(T, scratch, [&](auto& state, int64_t slot, int64_t r0, int64_t n) {
    auto& [mixed, dmixed] = state;
    const float* ar = a.data_ptr<float>() + r0 * A;
    const float* ur = u.data_ptr<float>() + r0 * u.stride(0);
    const uint8_t* kr = keep ? keep->data_ptr<uint8_t>() + r0 * A : nullptr;
    const float* g = dout.data_ptr<float>() + r0 * D;
    const float* m = mean.data_ptr<float>() + r0;
    const float* s = rstd.data_ptr<float>() + r0;
    // The GEMM's input again, from the saved statistics.
    rows(n, A, ar, nw, nb, ur, u.stride(0), kr, static_cast<float>(scale), m, s, mixed.data());
    gemm(true, false, D, A, n, 1.0f, g, D, mixed.data(), A, 1.0f, linear.weight(slot), A);
    float* __restrict db = linear.bias(slot);
    for (int64_t r = 0; r < n; ++r)
      for (int64_t j = 0; j < D; ++j) db[j] += g[r * D + j];
    gemm(false, false, n, A, D, 1.0f, g, D, weight.data_ptr<float>(), A, 0.0f, dmixed.data(), A);
    rows_backward(n, A, dmixed.data(), ar, nw, nb, ur, u.stride(0), kr, static_cast<float>(scale), m, s,
                  da.data_ptr<float>() + r0 * A, du.data_ptr<float>() + r0 * A, norm.weight(slot), norm.bias(slot));
  });
  auto [dweight, dbias] = linear.total({D, A}, a.options());
  auto [dnorm_weight, dnorm_bias] = norm.total({A}, a.options());
  return {da, du, dnorm_weight, dnorm_bias, dweight, dbias};
}

// The stack's input. x [T, D] contiguous, table [P, D] contiguous, rows [T] int64 in [0, P), keep [T, D]
// uint8 or none -> y [T, D]. No fast-math, no FMA contraction: each product and sum rounds as in PyTorch's ops.
#pragma GCC push_options
#pragma GCC optimize("no-fast-math", "fp-contract=off")
void check_input(const Tensor& x, const Tensor& rows, int64_t table_rows, const std::optional<Tensor>& keep) {
  check_contiguous_rows(x, "x");
  TORCH_CHECK(rows.dim() == 1 && rows.size(0) == x.size(0) && rows.scalar_type() == at::kLong && rows.is_contiguous(),
              "gr_cpu_layer: rows must be contiguous int64 [T]");
  const int64_t* r = rows.data_ptr<int64_t>();
  const bool inside = std::all_of(r, r + rows.size(0), [&](int64_t i) { return i >= 0 && i < table_rows; });
  TORCH_CHECK(inside, "gr_cpu_layer: rows must lie in [0, ", table_rows, ")");
  TORCH_CHECK(!keep || (keep->sizes() == x.sizes() && keep->scalar_type() == at::kByte && keep->is_contiguous()),
              "gr_cpu_layer: keep must be contiguous uint8 [T, D]");
}

Tensor input_forward(const Tensor& x, double scale, const Tensor& table, const Tensor& rows,
                     const std::optional<Tensor>& keep, double keep_scale) {
  check_contiguous_rows(table, "table");
  TORCH_CHECK(table.size(1) == x.size(1), "gr_cpu_layer: the table's rows must be as wide as x's");
  check_input(x, rows, table.size(0), keep);
  const int64_t D = x.size(1);
  Tensor y = at::empty_like(x);
  const float* xs = x.data_ptr<float>();
  const float* ts = table.data_ptr<float>();
  const int64_t* r = rows.data_ptr<int64_t>();
  const uint8_t* kept = keep ? keep->data_ptr<uint8_t>() : nullptr;
  float* ys = y.data_ptr<float>();
  const float s = static_cast<float>(scale), ks = static_cast<float>(keep_scale);
  at::parallel_for(0, x.size(0), kBlock, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* __restrict xi = xs + t * D;
      const float* __restrict ti = ts + r[t] * D;
      float* __restrict yi = ys + t * D;
      if (kept) {
        const uint8_t* __restrict ki = kept + t * D;
        for (int64_t c = 0; c < D; ++c) yi[c] = (xi[c] * s + ti[c]) * (static_cast<float>(ki[c]) * ks);
      } else {
        for (int64_t c = 0; c < D; ++c) yi[c] = xi[c] * s + ti[c];
      }
    }
  });
  return y;
}

// input_forward's gradients: dy [T, D] -> (dx [T, D], dtable [table_rows, D]). dx by ranges of tokens; the
// table by ranges of its rows, each thread going through the tokens in order for the rows it owns,
// so that each element sums its tokens in order (index_add_'s order) and no cache line is written
// by two threads.
std::tuple<Tensor, Tensor> input_backward(const Tensor& dy, double scale, const Tensor& rows, int64_t table_rows,
                                          const std::optional<Tensor>& keep, double keep_scale) {
  check_input(dy, rows, table_rows, keep);
  const int64_t T = dy.size(0), D = dy.size(1);
  Tensor dx = at::empty_like(dy);
  Tensor dtable = at::zeros({table_rows, D}, dy.options());
  const float* g = dy.data_ptr<float>();
  const int64_t* r = rows.data_ptr<int64_t>();
  const uint8_t* kept = keep ? keep->data_ptr<uint8_t>() : nullptr;
  float* dxs = dx.data_ptr<float>();
  float* dts = dtable.data_ptr<float>();
  const float s = static_cast<float>(scale), ks = static_cast<float>(keep_scale);
  // v = dy [* keep * keep_scale] for token t into out, then out[c] = v * s or out[c] += v.
  const auto apply = [&](int64_t t, float* __restrict out, auto&& store) {
    const float* __restrict gi = g + t * D;
    if (kept) {
      const uint8_t* __restrict ki = kept + t * D;
      for (int64_t c = 0; c < D; ++c) store(out[c], gi[c] * (static_cast<float>(ki[c]) * ks));
    } else {
      for (int64_t c = 0; c < D; ++c) store(out[c], gi[c]);
    }
  };
  at::parallel_for(0, T, kBlock, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) apply(t, dxs + t * D, [s](float& o, float v) { o = v * s; });
  });
  at::parallel_for(0, table_rows, 1, [&](int64_t first, int64_t last) {
    for (int64_t t = 0; t < T; ++t)
      if (r[t] >= first && r[t] < last) apply(t, dts + r[t] * D, [](float& o, float v) { o += v; });
  });
  return {dx, dtable};
}
#pragma GCC pop_options

}  // namespace

TORCH_LIBRARY(gr_cpu_layer, m) {
  m.def(
      "output_forward(Tensor a, Tensor u, Tensor? keep, float scale, Tensor norm_weight, Tensor norm_bias, float eps, "
      "Tensor weight, Tensor bias, Tensor x, bool bf16=False) -> (Tensor, Tensor, Tensor)");
  m.def(
      "output_backward(Tensor dout, Tensor a, Tensor u, Tensor? keep, float scale, Tensor norm_weight, "
      "Tensor norm_bias, Tensor weight, Tensor mean, Tensor rstd, bool bf16=False) -> "
      "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "projection_forward(Tensor x, Tensor norm_weight, Tensor norm_bias, float eps, Tensor weight, Tensor bias, "
      "int[] sizes, bool keep_grad, bool bf16=False) -> (Tensor[], Tensor[], Tensor, Tensor)");
  m.def(
      "projection_backward(Tensor[] grads, Tensor x, Tensor norm_weight, Tensor norm_bias, Tensor weight, "
      "Tensor[] silu_grads, Tensor mean, Tensor rstd, bool bf16=False) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "norm_forward(Tensor x, Tensor weight, Tensor bias, Tensor? u, Tensor? keep, float scale, float eps) -> "
      "(Tensor, Tensor, Tensor)");
  m.def(
      "norm_backward(Tensor dy, Tensor x, Tensor weight, Tensor bias, Tensor? u, Tensor? keep, Tensor mean, "
      "Tensor rstd, float scale) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("input_forward(Tensor x, float scale, Tensor table, Tensor rows, Tensor? keep, float keep_scale) -> Tensor");
  m.def(
      "input_backward(Tensor dy, float scale, Tensor rows, int table_rows, Tensor? keep, float keep_scale) -> "
      "(Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(gr_cpu_layer, CPU, m) {
  m.impl("input_forward", &input_forward);
  m.impl("input_backward", &input_backward);
  m.impl("projection_forward", &projection_forward);
  m.impl("projection_backward", &projection_backward);
  m.impl("output_forward", &output_forward);
  m.impl("output_backward", &output_backward);
  m.impl("norm_forward", &norm_forward);
  m.impl("norm_backward", &norm_backward);
}
