// gr_silu (gr_silu.h) as an op, so that its tests can check it against the exact SiLU: the kernels
// call the header directly.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "gr_silu.h"

#include <tuple>

namespace {

// z: contiguous fp32 -> (SiLU(z), SiLU'(z)), each shaped as z.
std::tuple<at::Tensor, at::Tensor> silu(const at::Tensor& z) {
  TORCH_CHECK(z.scalar_type() == at::kFloat && z.is_contiguous(), "gr_cpu_silu: z must be contiguous fp32");
  at::Tensor y = at::empty_like(z), grad = at::empty_like(z);
  gr_silu::silu(z.data_ptr<float>(), y.data_ptr<float>(), grad.data_ptr<float>(), z.numel());
  return {y, grad};
}

}  // namespace

TORCH_LIBRARY(gr_cpu_silu, m) { m.def("silu(Tensor z) -> (Tensor, Tensor)"); }

TORCH_LIBRARY_IMPL(gr_cpu_silu, CPU, m) { m.impl("silu", &silu); }
