// Per-thread partial sums for gr's fused CPU kernels, added up in thread order after the parallel
// region: a result then does not depend on which thread finished first (a lock-and-add merge gives
// different roundings from run to run on three or more threads). at::parallel_for on OpenMP hands
// each thread one contiguous range, so for a given thread count the partials and their order are fixed.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include "gr_blas.h"

#include <cstdint>
#include <vector>

namespace gr_parallel {

class ThreadSums {
 public:
  // Call outside the parallel region: one zeroed buffer of `size` floats per intra-op thread.
  explicit ThreadSums(int64_t size) : size_(size) {
    for (int t = 0; t < at::get_num_threads(); ++t) parts_.emplace_back(size, true);
  }
  // This thread's buffer; call inside at::parallel_for.
  float* local() {
    const size_t thread = static_cast<size_t>(at::get_thread_num());
    TORCH_CHECK(thread < parts_.size(), "gr_parallel: thread ", thread, " of ", parts_.size());
    return parts_[thread].data();
  }
  // out[0, size) += the partials, thread 0 first.
  void add_to(float* out) const { add_rows_to(out, size_, size_); }
  // The same for buffers of rows of `stride` floats of which the first `width` count (padded rows):
  // out row r [0, width) += the partials' row r, out's rows packed (width apart).
  void add_rows_to(float* out, int64_t width, int64_t stride) const {
    for (const gr_blas::AlignedFloats& part : parts_)
      for (int64_t r = 0; r * stride < size_; ++r)
        for (int64_t i = 0; i < width; ++i) out[r * width + i] += part.data()[r * stride + i];
  }

 private:
  int64_t size_;
  std::vector<gr_blas::AlignedFloats> parts_;  // 64-byte aligned: GEMMs accumulate into them
};

}  // namespace gr_parallel
