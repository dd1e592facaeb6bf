// Row-major single-precision GEMM on the BLAS inside PyTorch's x86 builds (MKL's sgemm_), for gr's
// fused CPU kernels that multiply small tiles inside at::parallel_for. Built by gr/ops/native.py; where
// the symbols are missing the library fails to load and the PyTorch code runs instead.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <tuple>

extern "C" {
void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const float* alpha,
            const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
            const int* ldc);
int MKL_Set_Num_Threads_Local(int nt);  // the C API; the lower-case symbol takes a pointer
}

namespace gr_blas {

// Row-major C[M, N] = alpha * op(A) op(B) + beta * C; op(A) is [M, K_], op(B) is [K_, N].
inline void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                 int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  // Column-major BLAS sees each row-major matrix transposed: C^T = op(B)^T op(A)^T.
  const char ta = trans_a ? 'T' : 'N', tb = trans_b ? 'T' : 'N';
  const int M = static_cast<int>(n), N = static_cast<int>(m), K = static_cast<int>(k);
  const int LA = static_cast<int>(ldb), LB = static_cast<int>(lda), LC = static_cast<int>(ldc);
  sgemm_(&tb, &ta, &M, &N, &K, &alpha, b, &LA, a, &LB, &beta, c, &LC);
}

// n floats aligned to 64 bytes, like PyTorch's CPU tensors, for GEMM operands: MKL picks its code
// path by the operands' alignment, so scratch at a varying alignment (std::vector's) would round
// differently from run to run.
class AlignedFloats {
 public:
  explicit AlignedFloats(int64_t n, bool zeroed = false) {
    const size_t bytes = (static_cast<size_t>(n) * sizeof(float) + 63) / 64 * 64;
    data_.reset(static_cast<float*>(std::aligned_alloc(64, bytes > 0 ? bytes : 64)));
    if (!data_) throw std::bad_alloc();
    if (zeroed) std::memset(data_.get(), 0, bytes);
  }
  float* data() const { return data_.get(); }

 private:
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  std::unique_ptr<float[], Free> data_;
};

// One AlignedFloats of each size, e.g. a thread's scratch tiles.
template <typename... Sizes>
auto aligned_floats(Sizes... sizes) {
  return std::make_tuple(AlignedFloats(sizes)...);
}

// Restores MKL's thread count for this thread on exit; GEMMs inside parallel_for run on one thread.
struct OneBlasThread {
  int previous;
  OneBlasThread() : previous(MKL_Set_Num_Threads_Local(1)) {}
  ~OneBlasThread() { MKL_Set_Num_Threads_Local(previous); }
};

}  // namespace gr_blas
