// The HSTU layer's pointwise steps on CPU (fp32), one pass over each row: gr.hstu.pointwise.
//
// * norm_forward / norm_backward: y = (LN(x) * weight + bias) [* u] [* keep * scale]. HSTU runs it
//   twice a layer: on the layer's input (LN alone) and on the attention output (LN(A V) * U, then
//   dropout). With D = 50 the unfused ops are bound by memory and per-op overhead, and PyTorch's CPU
//   LayerNorm backward is slow for short rows (its weight gradient is a second pass over the whole
//   tensor); here each row is read once forward and once backward, and the weight and bias
//   gradients are summed per thread.
// * silu_split_backward: the gradient of split(SiLU(x)) into U, V, Q, K from the four parts'
//   gradients in one pass, where autograd would first concatenate them and then run SiLU's backward.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <mutex>
#include <optional>
#include <tuple>
#include <vector>

namespace {

using at::Tensor;

constexpr int64_t kGrain = 256;  // rows per task

void check_rows(const Tensor& t, const Tensor& x, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 2 && t.size(0) == x.size(0) && t.size(1) == x.size(1) &&
                  t.stride(1) == 1,
              "gr_cpu_pointwise: ", name, " must be fp32 [T, D] with unit column stride, like x");
}

void check_inputs(const Tensor& x, const Tensor& weight, const Tensor& bias, const std::optional<Tensor>& u,
                  const std::optional<Tensor>& keep) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "gr_cpu_pointwise: x must be contiguous fp32 [T, D]");
  const int64_t D = x.size(1);
  TORCH_CHECK(weight.numel() == D && bias.numel() == D && weight.scalar_type() == at::kFloat &&
                  bias.scalar_type() == at::kFloat && weight.is_contiguous() && bias.is_contiguous(),
              "gr_cpu_pointwise: weight and bias must be contiguous fp32 [D]");
  if (u) check_rows(*u, x, "u");
  if (keep)
    TORCH_CHECK(keep->scalar_type() == at::kByte && keep->is_contiguous() && keep->numel() == x.numel(),
                "gr_cpu_pointwise: keep must be a contiguous uint8 mask of x's size");
}

// The row loops, specialised on whether there is a gate and a mask so that each compiles to straight
// vector code (D is short: a branch or a possible alias in the loop costs as much as the work).
template <bool kGate, bool kKeep>
void forward_rows(int64_t begin, int64_t end, int64_t D, const float* __restrict x, const float* __restrict w,
                  const float* __restrict b, const float* __restrict u, int64_t u_stride,
                  const uint8_t* __restrict keep, float scale, float eps, float* __restrict y,
                  float* __restrict mean, float* __restrict rstd) {
  for (int64_t r = begin; r < end; ++r) {
    const float* __restrict row = x + r * D;
    float sum = 0.0f;
    for (int64_t i = 0; i < D; ++i) sum += row[i];
    const float m = sum / D;
    float var = 0.0f;
    for (int64_t i = 0; i < D; ++i) var += (row[i] - m) * (row[i] - m);
    const float inv = 1.0f / std::sqrt(var / D + eps);
    mean[r] = m;
    rstd[r] = inv;
    float* __restrict out = y + r * D;
    const float* __restrict gate = u + r * u_stride;
    const uint8_t* __restrict kept = keep + r * D;
    for (int64_t i = 0; i < D; ++i) {
      float v = (row[i] - m) * inv * w[i] + b[i];
      if constexpr (kGate) v *= gate[i];
      if constexpr (kKeep) v *= static_cast<float>(kept[i]) * scale;
      out[i] = v;
    }
  }
}

template <bool kGate, bool kKeep>
void backward_rows(int64_t begin, int64_t end, int64_t D, const float* __restrict dy, const float* __restrict x,
                   const float* __restrict w, const float* __restrict b, const float* __restrict u, int64_t u_stride,
                   const uint8_t* __restrict keep, float scale, const float* __restrict mean,
                   const float* __restrict rstd, float* __restrict dx, float* __restrict du, float* __restrict dw,
                   float* __restrict db, float* __restrict dz, float* __restrict xhat) {
  for (int64_t r = begin; r < end; ++r) {
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

// -> (y [T, D] fp32, mean [T], rstd [T]).
std::tuple<Tensor, Tensor, Tensor> norm_forward(const Tensor& x, const Tensor& weight, const Tensor& bias,
                                           const std::optional<Tensor>& u, const std::optional<Tensor>& keep,
                                           double scale, double eps) {
  check_inputs(x, weight, bias, u, keep);
  const int64_t T = x.size(0), D = x.size(1);
  Tensor y = at::empty({T, D}, x.options());
  Tensor mean = at::empty({T}, x.options());
  Tensor rstd = at::empty({T}, x.options());
  auto rows = !u ? (keep ? forward_rows<false, true> : forward_rows<false, false>)
                 : (keep ? forward_rows<true, true> : forward_rows<true, false>);
  const float* up = u ? u->data_ptr<float>() : nullptr;
  const int64_t u_stride = u ? u->stride(0) : 0;
  const uint8_t* kp = keep ? keep->data_ptr<uint8_t>() : nullptr;
  at::parallel_for(0, T, kGrain, [&](int64_t begin, int64_t end) {
    rows(begin, end, D, x.data_ptr<float>(), weight.data_ptr<float>(), bias.data_ptr<float>(), up, u_stride, kp,
         static_cast<float>(scale), static_cast<float>(eps), y.data_ptr<float>(), mean.data_ptr<float>(),
         rstd.data_ptr<float>());
  });
  return {y, mean, rstd};
}

// -> (dx [T, D], dweight [D], dbias [D], du [T, D] or an empty tensor without u), fp32.
std::tuple<Tensor, Tensor, Tensor, Tensor> norm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight,
                                                    const Tensor& bias, const std::optional<Tensor>& u,
                                                    const std::optional<Tensor>& keep, const Tensor& mean,
                                                    const Tensor& rstd, double scale) {
  check_inputs(x, weight, bias, u, keep);
  TORCH_CHECK(dy.is_contiguous() && dy.scalar_type() == at::kFloat && dy.sizes() == x.sizes(),
              "gr_cpu_pointwise: dy must be contiguous fp32 of x's shape");
  const int64_t T = x.size(0), D = x.size(1);
  Tensor dx = at::empty({T, D}, x.options());
  Tensor dweight = at::zeros({D}, x.options());
  Tensor dbias = at::zeros({D}, x.options());
  Tensor du = u ? at::empty({T, D}, x.options()) : at::empty({0}, x.options());
  auto rows = !u ? (keep ? backward_rows<false, true> : backward_rows<false, false>)
                 : (keep ? backward_rows<true, true> : backward_rows<true, false>);
  const float* up = u ? u->data_ptr<float>() : nullptr;
  const int64_t u_stride = u ? u->stride(0) : 0;
  const uint8_t* kp = keep ? keep->data_ptr<uint8_t>() : nullptr;
  float* dup = u ? du.data_ptr<float>() : nullptr;
  std::mutex merge;
  at::parallel_for(0, T, kGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> dw(D, 0.0f), db(D, 0.0f), dz(D), xhat(D);  // this task's share of dweight, dbias
    rows(begin, end, D, dy.data_ptr<float>(), x.data_ptr<float>(), weight.data_ptr<float>(), bias.data_ptr<float>(),
         up, u_stride, kp, static_cast<float>(scale), mean.data_ptr<float>(), rstd.data_ptr<float>(),
         dx.data_ptr<float>(), dup, dw.data(), db.data(), dz.data(), xhat.data());
    std::lock_guard<std::mutex> lock(merge);
    float* dwp = dweight.data_ptr<float>();
    float* dbp = dbias.data_ptr<float>();
    for (int64_t i = 0; i < D; ++i) {
      dwp[i] += dw[i];
      dbp[i] += db[i];
    }
  });
  return {dx, dweight, dbias, du};
}

// pre [T, N] fp32 contiguous, grads: the parts' gradients [T, n_i] fp32 (unit column stride, sum n_i = N)
// -> d pre [T, N] = concat(grads) * SiLU'(pre).
Tensor silu_split_backward(const Tensor& pre, at::TensorList grads) {
  TORCH_CHECK(pre.dim() == 2 && pre.scalar_type() == at::kFloat && pre.is_contiguous(),
              "gr_cpu_pointwise: pre must be contiguous fp32 [T, N]");
  const int64_t T = pre.size(0), N = pre.size(1);
  int64_t width = 0;
  for (const Tensor& g : grads) {
    TORCH_CHECK(g.dim() == 2 && g.size(0) == T && g.scalar_type() == at::kFloat && g.stride(1) == 1,
                "gr_cpu_pointwise: each part's gradient must be fp32 [T, n] with unit column stride");
    width += g.size(1);
  }
  TORCH_CHECK(width == N, "gr_cpu_pointwise: the parts' widths add up to ", width, ", pre has ", N);
  Tensor dpre = at::empty({T, N}, pre.options());
  const float* x = pre.data_ptr<float>();
  float* out = dpre.data_ptr<float>();
  at::parallel_for(0, T, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      int64_t offset = 0;
      for (const Tensor& g : grads) {
        const int64_t n = g.size(1);
        const float* __restrict gr = g.data_ptr<float>() + r * g.stride(0);
        const float* __restrict xr = x + r * N + offset;
        float* __restrict o = out + r * N + offset;
        for (int64_t j = 0; j < n; ++j) {
          const float sig = 1.0f / (1.0f + std::exp(-xr[j]));
          o[j] = gr[j] * sig * (1.0f + xr[j] * (1.0f - sig));
        }
        offset += n;
      }
    }
  });
  return dpre;
}

}  // namespace

TORCH_LIBRARY(gr_cpu_pointwise, m) {
  m.def(
      "norm_forward(Tensor x, Tensor weight, Tensor bias, Tensor? u, Tensor? keep, float scale, float eps) -> "
      "(Tensor, Tensor, Tensor)");
  m.def(
      "norm_backward(Tensor dy, Tensor x, Tensor weight, Tensor bias, Tensor? u, Tensor? keep, Tensor mean, Tensor rstd, "
      "float scale) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("silu_split_backward(Tensor pre, Tensor[] grads) -> Tensor");
}

TORCH_LIBRARY_IMPL(gr_cpu_pointwise, CPU, m) {
  m.impl("norm_forward", &norm_forward);
  m.impl("norm_backward", &norm_backward);
  m.impl("silu_split_backward", &silu_split_backward);
}
