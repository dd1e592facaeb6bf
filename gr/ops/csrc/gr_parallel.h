// Work sharing and partial sums for gr's fused CPU kernels. Partials (SlotSums) are added up in a
// fixed order after the parallel region, so that a result does not depend on which thread finished
// first (a lock-and-add merge gives different roundings from run to run on three or more threads):
// * one partial per slot of work of dynamic_for, which hands work to whichever thread is free (the
//   slots are fixed by the work alone: sums repeat bitwise on any thread count);
// * or one per thread under at::parallel_for, which on OpenMP hands each thread one contiguous range
//   (for a given thread count the partials and their order are fixed).
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include "gr_blas.h"

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace gr_parallel {

// Runs body(state, i) for every i in [0, n) on the intra-op threads, a thread taking the next i each
// time it finishes one, with one state = make_state() per thread and its GEMMs on one BLAS thread.
// A thread that the machine slows down (another process, a busy sibling core) takes fewer, where a
// split fixed in advance leaves the other thread waiting at the end. Which thread runs an i varies
// from run to run: what a body sums goes per i (SlotSums), not per thread.
template <typename MakeState, typename Body>
void dynamic_for(int64_t n, const MakeState& make_state, const Body& body) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), n), 1, [&](int64_t, int64_t) {
    gr_blas::OneBlasThread one;
    auto state = make_state();
    for (int64_t i = next++; i < n; i = next++) body(state, i);
  });
}

// One zeroed partial sum of `size` floats per slot (dynamic_for's i, or at::get_thread_num()), each
// 64-byte aligned (GEMMs accumulate into them); added up in slot order.
class SlotSums {
 public:
  SlotSums(int64_t slots, int64_t size)
      : slots_(slots),
        size_(size),
        stride_((size + 15) / 16 * 16),
        data_(std::max<int64_t>(slots * stride_, 1), true) {}
  float* slot(int64_t s) const {
    TORCH_CHECK(s >= 0 && s < slots_, "gr_parallel: slot ", s, " of ", slots_);
    return data_.data() + s * stride_;
  }
  // out[0, size) += the partials, slot 0 first.
  void add_to(float* out) const { add_rows_to(out, size_, size_); }
  // The same for partials of rows of `stride` floats of which the first `width` count (padded rows):
  // out row r [0, width) += the partials' row r, out's rows packed (width apart).
  void add_rows_to(float* out, int64_t width, int64_t stride) const {
    for (int64_t s = 0; s < slots_; ++s) {
      const float* part = slot(s);
      for (int64_t r = 0; r * stride < size_; ++r)
        for (int64_t i = 0; i < width; ++i) out[r * width + i] += part[r * stride + i];
    }
  }

 private:
  int64_t slots_, size_, stride_;
  gr_blas::AlignedFloats data_;
};

}  // namespace gr_parallel
