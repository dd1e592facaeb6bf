// Single-threaded fp32 GEMM for the small tiles of gr's fused CPU kernels: AVX-512 where the build
// has it (-march=native), the BLAS inside PyTorch (gr_blas.h, MKL's sgemm_) otherwise.
//
// Why our own: MKL runs its AVX2 code on AMD CPUs, half of what AVX-512 machines such as Zen 4/5
// can do, and its per-call overhead is large next to our tiles (M <= 128, N and K ~ 25-200); on
// those shapes this kernel is 2-3x faster. It keeps a [kRows, kCols] block of C in 16 zmm
// registers for the whole K loop, reads B as rows of kCols (a transposed B is first transposed into a
// panel on the stack: callers that reuse one B^T transpose it once with `transpose`), and
// broadcasts A one element at a time, in either layout. A last few columns past a multiple of 16
// (N = 50: 48 + 2) go on the row lanes instead (narrow_columns), where a register of 16 column lanes
// would do 16 lanes of work for 2. The summation order is fixed (k ascending within passes of
// kDepth, on either path), so results repeat bitwise whatever the alignment or the thread.
#pragma once

#include "gr_blas.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace gr_gemm {

#if defined(__AVX512F__)

constexpr int64_t kRows = 8;     // rows of C per register block
constexpr int64_t kCols = 32;    // columns of C per register block: two zmm
constexpr int64_t kDepth = 256;  // K per pass: a packed [kDepth, kCols] panel is 32 KB
constexpr int64_t kNarrow = 4;   // at most this many columns past a multiple of 16 go on the row lanes

inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << std::max<int64_t>(n, 0)) - 1);
}

// r[c] = column c of the 16 x 16 block whose rows were r[0..15]: unpack pairs of rows, then pairs
// of pairs, then exchange 128-bit lanes twice.
inline void transpose16(__m512 r[16]) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i + c]: per 128-bit lane L, column 4L + c of rows 4i .. 4i + 3
    u[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512 even01 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x88), odd01 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xDD);
    const __m512 even23 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x88);
    const __m512 odd23 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xDD);
    r[c] = _mm512_shuffle_f32x4(even01, even23, 0x88);
    r[8 + c] = _mm512_shuffle_f32x4(even01, even23, 0xDD);
    r[4 + c] = _mm512_shuffle_f32x4(odd01, odd23, 0x88);
    r[12 + c] = _mm512_shuffle_f32x4(odd01, odd23, 0xDD);
  }
}

// dst[kk * ldd + j] = src[j * lds + kk] for j < n, kk < k: the [k, n] transpose of a row-major [n, k],
// 16 x 16 blocks at a time in registers.
inline void transpose(int64_t n, int64_t k, const float* src, int64_t lds, float* dst, int64_t ldd) {
  __m512 r[16];
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t rows = std::min<int64_t>(16, n - j0);
    const __mmask16 row_mask = first_lanes(rows);
    for (int64_t k0 = 0; k0 < k; k0 += 16) {
      const int64_t cols = std::min<int64_t>(16, k - k0);
      const __mmask16 col_mask = first_lanes(cols);
      for (int64_t i = 0; i < 16; ++i)
        r[i] = i < rows ? _mm512_maskz_loadu_ps(col_mask, src + (j0 + i) * lds + k0) : _mm512_setzero_ps();
      transpose16(r);
      for (int64_t c = 0; c < cols; ++c) _mm512_mask_storeu_ps(dst + (k0 + c) * ldd + j0, row_mask, r[c]);
    }
  }
}

// A's element (i, k) at data[i * row_stride + k * col_stride]: either layout, read in place.
struct View {
  const float* data;
  int64_t row_stride, col_stride;
};

// C[0:R, lanes] = (first ? beta * C : C) + alpha * sum_k A[0:R, k] B[k, lanes] for k < depth, with
// `b` at B's row 0 of this column block (row stride ldb) and the lanes the two masks select; kTwo:
// two registers of 16 columns, else one (hi selects none).
template <int R, bool kTwo>
inline void block(int64_t depth, float alpha, View a, const float* b, int64_t ldb, float beta, bool first, float* c,
                  int64_t ldc, __mmask16 lo, __mmask16 hi) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < depth; ++k) {
    const __m512 b0 = _mm512_maskz_loadu_ps(lo, b + k * ldb);
    const __m512 b1 = kTwo ? _mm512_maskz_loadu_ps(hi, b + k * ldb + 16) : _mm512_setzero_ps();
    const float* ak = a.data + k * a.col_stride;
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_set1_ps(ak[r * a.row_stride]);
      acc[r][0] = _mm512_fmadd_ps(x, b0, acc[r][0]);
      if constexpr (kTwo) acc[r][1] = _mm512_fmadd_ps(x, b1, acc[r][1]);
    }
  }
  const __m512 va = _mm512_set1_ps(alpha);
  const float scale = first ? beta : 1.0f;
  for (int r = 0; r < R; ++r) {
    float* row = c + r * ldc;
    __m512 c0 = _mm512_mul_ps(va, acc[r][0]), c1 = _mm512_mul_ps(va, acc[r][1]);
    if (scale != 0.0f) {  // beta == 0 does not read C, which may hold NaN
      const __m512 vs = _mm512_set1_ps(scale);
      c0 = _mm512_fmadd_ps(vs, _mm512_maskz_loadu_ps(lo, row), c0);
      if constexpr (kTwo) c1 = _mm512_fmadd_ps(vs, _mm512_maskz_loadu_ps(hi, row + 16), c1);
    }
    _mm512_mask_storeu_ps(row, lo, c0);
    if constexpr (kTwo) _mm512_mask_storeu_ps(row + 16, hi, c1);
  }
}

// block<R, kTwo> for the last rows < R of C, down to one.
template <int R, bool kTwo>
inline void rows_block(int64_t rows, int64_t depth, float alpha, View a, const float* b, int64_t ldb, float beta,
                       bool first, float* c, int64_t ldc, __mmask16 lo, __mmask16 hi) {
  if constexpr (R > 1) {
    if (rows < R) return rows_block<R - 1, kTwo>(rows, depth, alpha, a, b, ldb, beta, first, c, ldc, lo, hi);
  }
  block<R, kTwo>(depth, alpha, a, b, ldb, beta, first, c, ldc, lo, hi);
}

// C[0:m, 0:R] for R <= kNarrow columns, 32 rows on the lanes of two registers at a time: A's columns
// are loaded (A packed transposed per pass first when it is stored row-major), B's R columns
// broadcast (B(k, j) at b[j * ldbj + k * ldbk]). The same products, summed in the same order and
// stored per pass as block()'s, so each element is bitwise what block() would give it.
template <int R>
inline void narrow_columns(bool trans_a, int64_t m, int64_t k, float alpha, const float* a, int64_t lda,
                           const float* b, int64_t ldbj, int64_t ldbk, float beta, float* c, int64_t ldc) {
  alignas(64) float packed[kDepth * 32];
  alignas(64) float lanes[32];
  const __m512 va = _mm512_set1_ps(alpha);
  for (int64_t i0 = 0; i0 < m; i0 += 32) {
    const int64_t rows = std::min<int64_t>(32, m - i0);
    const __mmask16 lo = first_lanes(rows), hi = first_lanes(rows - 16);
    for (int64_t k0 = 0; k0 < k; k0 += kDepth) {
      const int64_t depth = std::min(kDepth, k - k0);
      const float* at = a + k0 * lda + i0;  // A^T [depth, rows], rows ld apart
      int64_t ld = lda;
      if (!trans_a) {
        transpose(rows, depth, a + i0 * lda + k0, lda, packed, 32);
        at = packed;
        ld = 32;
      }
      __m512 acc[R][2];
      for (int j = 0; j < R; ++j) acc[j][0] = acc[j][1] = _mm512_setzero_ps();
      const float* bk = b + k0 * ldbk;
      for (int64_t kk = 0; kk < depth; ++kk, bk += ldbk) {
        const __m512 x0 = _mm512_maskz_loadu_ps(lo, at + kk * ld);
        const __m512 x1 = _mm512_maskz_loadu_ps(hi, at + kk * ld + 16);
        for (int j = 0; j < R; ++j) {
          const __m512 y = _mm512_set1_ps(bk[j * ldbj]);
          acc[j][0] = _mm512_fmadd_ps(x0, y, acc[j][0]);
          acc[j][1] = _mm512_fmadd_ps(x1, y, acc[j][1]);
        }
      }
      const float scale = k0 == 0 ? beta : 1.0f;
      for (int j = 0; j < R; ++j) {
        _mm512_store_ps(lanes, _mm512_mul_ps(va, acc[j][0]));
        _mm512_store_ps(lanes + 16, _mm512_mul_ps(va, acc[j][1]));
        for (int64_t i = 0; i < rows; ++i) {
          float* out = c + (i0 + i) * ldc + j;
          *out = scale != 0.0f ? std::fma(scale, *out, lanes[i]) : lanes[i];
        }
      }
    }
  }
}

// Row-major C[M, N] = alpha * op(A) op(B) + beta * C; op(A) is [M, K], op(B) is [K, N]: the BLAS's
// sgemm contract in row-major terms (C is not read when beta == 0). Not inlined: inside the callers'
// loops GCC spilled a B register to the stack.
__attribute__((noinline, noclone)) inline void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                 int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m <= 0 || n <= 0) return;
  if (k <= 0) {
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) c[i * ldc + j] = beta == 0.0f ? 0.0f : beta * c[i * ldc + j];
    return;
  }
  const int64_t tail = n % 16;
  const int64_t narrow = n > 16 && m >= 8 && tail <= kNarrow ? tail : 0;  // columns on the row lanes
  const int64_t wide = n - narrow;
  alignas(64) float panel[kDepth * kCols];
  for (int64_t j0 = 0; j0 < wide; j0 += kCols) {
    const int64_t cols = std::min(kCols, wide - j0);
    const __mmask16 lo = first_lanes(cols), hi = first_lanes(cols - 16);
    for (int64_t k0 = 0; k0 < k; k0 += kDepth) {
      const int64_t depth = std::min(kDepth, k - k0);
      const float* bp = b + k0 * ldb + j0;
      int64_t bld = ldb;
      if (trans_b) {  // B is stored [N, K]
        transpose(cols, depth, b + j0 * ldb + k0, ldb, panel, kCols);
        bp = panel;
        bld = kCols;
      }
      const View av = trans_a ? View{a + k0 * lda, 1, lda} : View{a + k0, lda, 1};
      for (int64_t i0 = 0; i0 < m; i0 += kRows) {
        const View ai{av.data + i0 * av.row_stride, av.row_stride, av.col_stride};
        const int64_t rows = std::min(kRows, m - i0);
        float* ci = c + i0 * ldc + j0;
        if (cols > 16)
          rows_block<kRows, true>(rows, depth, alpha, ai, bp, bld, beta, k0 == 0, ci, ldc, lo, hi);
        else
          rows_block<kRows, false>(rows, depth, alpha, ai, bp, bld, beta, k0 == 0, ci, ldc, lo, hi);
      }
    }
  }
  if (narrow > 0) {
    const float* bn = trans_b ? b + wide * ldb : b + wide;
    const int64_t ldbj = trans_b ? ldb : 1, ldbk = trans_b ? 1 : ldb;
    const auto columns = narrow == 1   ? narrow_columns<1>
                         : narrow == 2 ? narrow_columns<2>
                         : narrow == 3 ? narrow_columns<3>
                                       : narrow_columns<4>;
    columns(trans_a, m, k, alpha, a, lda, bn, ldbj, ldbk, beta, c + wide, ldc);
  }
}

#else  // no AVX-512 in this build: the BLAS

inline void transpose(int64_t n, int64_t k, const float* src, int64_t lds, float* dst, int64_t ldd) {
  for (int64_t j = 0; j < n; ++j)
    for (int64_t kk = 0; kk < k; ++kk) dst[kk * ldd + j] = src[j * lds + kk];
}

using gr_blas::gemm;

#endif

}  // namespace gr_gemm
