// Stores past the cache for gr's fused CPU kernels: results that nothing reads before backward.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace gr_stream {

// dst[0, n) = src[0, n), past the cache where the build has AVX-512 (streaming stores from dst's first
// 64-byte boundary on). A plain store to a line that is not cached first reads it from memory, and
// the lines would push out what the next ops read.
inline void store_for_backward(float* dst, const float* src, int64_t n) {
#if defined(__AVX512F__)
  int64_t i = 0;
  for (; i < n && (reinterpret_cast<uintptr_t>(dst + i) & 63) != 0; ++i) dst[i] = src[i];
  for (; i + 16 <= n; i += 16) _mm512_stream_ps(dst + i, _mm512_loadu_ps(src + i));
  for (; i < n; ++i) dst[i] = src[i];
  _mm_sfence();
#else
  std::memcpy(dst, src, n * sizeof(float));
#endif
}

}  // namespace gr_stream
