// gr_gemm (gr_gemm.h) as ops, so that its tests can check it against torch.matmul on any shape:
// the kernels call the header directly.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "gr_gemm.h"

namespace {

using at::Tensor;

void check_matrix(const Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == at::kFloat && t.stride(1) == 1, "gr_cpu_gemm: ", name,
              " must be a 2-d fp32 tensor with unit column stride");
}

// c = alpha * op(a) op(b) + beta * c, in place; op transposes when asked; bf16: in bf16 math (gemm_bf16).
void gemm(const Tensor& a, const Tensor& b, const Tensor& c, bool trans_a, bool trans_b, double alpha, double beta,
          bool bf16) {
  check_matrix(a, "a");
  check_matrix(b, "b");
  check_matrix(c, "c");
  const int64_t m = trans_a ? a.size(1) : a.size(0), k = trans_a ? a.size(0) : a.size(1);
  const int64_t n = trans_b ? b.size(0) : b.size(1);
  TORCH_CHECK((trans_b ? b.size(1) : b.size(0)) == k && c.size(0) == m && c.size(1) == n,
              "gr_cpu_gemm: shapes do not chain: op(a) [", m, ", ", k, "], op(b) [", trans_b ? b.size(1) : b.size(0),
              ", ", n, "], c ", c.sizes());
  gr_gemm::gemm_for(bf16)(trans_a, trans_b, m, n, k, static_cast<float>(alpha), a.data_ptr<float>(), a.stride(0),
                b.data_ptr<float>(), b.stride(0), static_cast<float>(beta), c.data_ptr<float>(), c.stride(0));
}

// Whether gemm_bf16 runs bf16 instructions in this build (else it computes in fp32).
bool bf16_instructions() { return gr_gemm::kBf16Instructions; }

// x [n, k] -> x^T [k, n], contiguous.
Tensor transpose(const Tensor& x) {
  check_matrix(x, "x");
  Tensor out = at::empty({x.size(1), x.size(0)}, x.options());
  gr_gemm::transpose(x.size(0), x.size(1), x.data_ptr<float>(), x.stride(0), out.data_ptr<float>(), x.size(0));
  return out;
}

}  // namespace

TORCH_LIBRARY(gr_cpu_gemm, m) {
  m.def(
      "gemm(Tensor a, Tensor b, Tensor(a!) c, bool trans_a, bool trans_b, float alpha, float beta, bool bf16=False) "
      "-> ()");
  m.def("transpose(Tensor x) -> Tensor");
  m.def("bf16_instructions() -> bool", &bf16_instructions);  // no tensor to dispatch on: every backend
}

TORCH_LIBRARY_IMPL(gr_cpu_gemm, CPU, m) {
  m.impl("gemm", &gemm);
  m.impl("transpose", &transpose);
}
