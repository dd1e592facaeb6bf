// Single-threaded fp32 GEMM for the small tiles of gr's fused CPU kernels: AVX-512 where the build
// has it (-march=native), the BLAS inside PyTorch (gr_blas.h, MKL's sgemm_) otherwise; and gemm_bf16,
// the same contract in bf16 math (AVX-512 BF16; at the end of this file), for CPU autocast to bf16.
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

// dst[kk * ldd + j] = row(j)[kk] for j < n, kk < k: the [k, n] transpose of n rows of k floats, each
// wherever row(j) (a const float*) puts it, 16 x 16 blocks at a time in registers.
template <typename Row>
inline void transpose_rows(int64_t n, int64_t k, const Row& row, float* dst, int64_t ldd) {
  __m512 r[16];
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t rows = std::min<int64_t>(16, n - j0);
    const __mmask16 row_mask = first_lanes(rows);
    for (int64_t k0 = 0; k0 < k; k0 += 16) {
      const int64_t cols = std::min<int64_t>(16, k - k0);
      const __mmask16 col_mask = first_lanes(cols);
      for (int64_t i = 0; i < 16; ++i)
        r[i] = i < rows ? _mm512_maskz_loadu_ps(col_mask, row(j0 + i) + k0) : _mm512_setzero_ps();
      transpose16(r);
      for (int64_t c = 0; c < cols; ++c) _mm512_mask_storeu_ps(dst + (k0 + c) * ldd + j0, row_mask, r[c]);
    }
  }
}

// dst[kk * ldd + j] = src[j * lds + kk] for j < n, kk < k: the [k, n] transpose of a row-major [n, k].
inline void transpose(int64_t n, int64_t k, const float* src, int64_t lds, float* dst, int64_t ldd) {
  transpose_rows(n, k, [&](int64_t j) { return src + j * lds; }, dst, ldd);
}

// A's element (i, k) at data[i * row_stride + k * col_stride]: either layout, read in place.
struct View {
  const float* data;
  int64_t row_stride, col_stride;
};

// C[0:R, lanes] = (first ? beta * C : C) + alpha * acc[0:R], lanes as the masks select (kTwo: two
// registers of 16 columns, else one; hi selects none).
template <int R, bool kTwo>
inline void store_block(const __m512 acc[R][2], float alpha, float beta, bool first, float* c, int64_t ldc,
                        __mmask16 lo, __mmask16 hi) {
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

// Where B's rows lie for Fp32Operands: row k at b + k * ldb (Strided), or at rows[k] + col (Pointed:
// rows anywhere, col this column block's first).
struct Strided {
  const float* b;
  int64_t ldb;
  const float* row(int64_t k) const { return b + k * ldb; }
};
struct Pointed {
  const float* const* rows;
  int64_t col;
  const float* row(int64_t k) const { return rows[k] + col; }
};

// fp32 operands of one register block: A read in place, B's rows of this column block where `b`
// says (BRows: Strided or Pointed), the lanes the masks select.
template <typename BRows>
struct Fp32Operands {
  View a;
  BRows b;
  __mmask16 lo, hi;

  Fp32Operands rows_from(int64_t i0) const {
    return {{a.data + i0 * a.row_stride, a.row_stride, a.col_stride}, b, lo, hi};
  }
  // acc[r] += sum_k A[r, k] B[k, lanes] for k < depth.
  template <int R, bool kTwo>
  void accumulate(int64_t depth, __m512 acc[R][2]) const {
    for (int64_t k = 0; k < depth; ++k) {
      const float* bk = b.row(k);
      const __m512 b0 = _mm512_maskz_loadu_ps(lo, bk);
      const __m512 b1 = kTwo ? _mm512_maskz_loadu_ps(hi, bk + 16) : _mm512_setzero_ps();
      const float* ak = a.data + k * a.col_stride;
      for (int r = 0; r < R; ++r) {
        const __m512 x = _mm512_set1_ps(ak[r * a.row_stride]);
        acc[r][0] = _mm512_fmadd_ps(x, b0, acc[r][0]);
        if constexpr (kTwo) acc[r][1] = _mm512_fmadd_ps(x, b1, acc[r][1]);
      }
    }
  }
};

// C[0:R, lanes] = (first ? beta * C : C) + alpha * sum_k A[0:R, k] B[k, lanes] over the operands' depth.
template <int R, bool kTwo, typename Operands>
inline void block(int64_t depth, float alpha, const Operands& x, float beta, bool first, float* c, int64_t ldc) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  x.template accumulate<R, kTwo>(depth, acc);
  store_block<R, kTwo>(acc, alpha, beta, first, c, ldc, x.lo, x.hi);
}

// block<R, kTwo> for the last rows < R of C, down to one.
template <int R, bool kTwo, typename Operands>
inline void rows_block(int64_t rows, int64_t depth, float alpha, const Operands& x, float beta, bool first, float* c,
                       int64_t ldc) {
  if constexpr (R > 1) {
    if (rows < R) return rows_block<R - 1, kTwo>(rows, depth, alpha, x, beta, first, c, ldc);
  }
  block<R, kTwo>(depth, alpha, x, beta, first, c, ldc);
}

// C[0:m] of one column block, kRows at a time: two registers of columns when cols > 16, else one.
template <typename Operands>
inline void column_block(int64_t m, int64_t cols, int64_t depth, float alpha, const Operands& x, float beta,
                         bool first, float* c, int64_t ldc) {
  for (int64_t i0 = 0; i0 < m; i0 += kRows) {
    const int64_t rows = std::min(kRows, m - i0);
    if (cols > 16)
      rows_block<kRows, true>(rows, depth, alpha, x.rows_from(i0), beta, first, c + i0 * ldc, ldc);
    else
      rows_block<kRows, false>(rows, depth, alpha, x.rows_from(i0), beta, first, c + i0 * ldc, ldc);
  }
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

// body(j0, cols, lo, hi, k0, depth) for each block of kCols columns [j0, j0 + cols) of n (lo, hi: the
// lanes of its two registers) and, within it, each pass [k0, k0 + depth) of kDepth of k: the order
// in which gemm and gemm_rows sum.
template <typename Body>
inline void column_passes(int64_t n, int64_t k, const Body& body) {
  for (int64_t j0 = 0; j0 < n; j0 += kCols) {
    const int64_t cols = std::min(kCols, n - j0);
    const __mmask16 lo = first_lanes(cols), hi = first_lanes(cols - 16);
    for (int64_t k0 = 0; k0 < k; k0 += kDepth) body(j0, cols, lo, hi, k0, std::min(kDepth, k - k0));
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
  column_passes(wide, k, [&](int64_t j0, int64_t cols, __mmask16 lo, __mmask16 hi, int64_t k0, int64_t depth) {
    const float* bp = b + k0 * ldb + j0;
    int64_t bld = ldb;
    if (trans_b) {  // B is stored [N, K]
      transpose(cols, depth, b + j0 * ldb + k0, ldb, panel, kCols);
      bp = panel;
      bld = kCols;
    }
    const View av = trans_a ? View{a + k0 * lda, 1, lda} : View{a + k0, lda, 1};
    column_block(m, cols, depth, alpha, Fp32Operands<Strided>{av, {bp, bld}, lo, hi}, beta, k0 == 0, c + j0, ldc);
  });
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

// gemm(false, trans_b, ...) with B's stored rows anywhere: row r at rows[r] (trans_b: B stored [N, K],
// row j is column j of op(B); else [K, N]). Each element is summed as gemm sums it (k ascending within
// passes of kDepth, columns in blocks of kCols, no narrow_columns), so it depends on the rows' values
// only: rows read through a page table give the bits of the same rows read in place.
__attribute__((noinline, noclone)) inline void gemm_rows(bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                                                         const float* a, int64_t lda, const float* const* rows,
                                                         float beta, float* c, int64_t ldc) {
  if (m <= 0 || n <= 0 || k <= 0) return gemm(false, trans_b, m, n, k, alpha, a, lda, nullptr, 0, beta, c, ldc);
  alignas(64) float panel[kDepth * kCols];
  column_passes(n, k, [&](int64_t j0, int64_t cols, __mmask16 lo, __mmask16 hi, int64_t k0, int64_t depth) {
    const View av{a + k0, lda, 1};
    if (trans_b) {
      transpose_rows(cols, depth, [&](int64_t j) { return rows[j0 + j] + k0; }, panel, kCols);
      const Fp32Operands<Strided> x{av, {panel, kCols}, lo, hi};
      column_block(m, cols, depth, alpha, x, beta, k0 == 0, c + j0, ldc);
    } else {
      const Fp32Operands<Pointed> x{av, {rows + k0, j0}, lo, hi};
      column_block(m, cols, depth, alpha, x, beta, k0 == 0, c + j0, ldc);
    }
  });
}

#else  // no AVX-512 in this build: the BLAS

inline void transpose(int64_t n, int64_t k, const float* src, int64_t lds, float* dst, int64_t ldd) {
  for (int64_t j = 0; j < n; ++j)
    for (int64_t kk = 0; kk < k; ++kk) dst[kk * ldd + j] = src[j * lds + kk];
}

using gr_blas::gemm;

// gemm(false, trans_b, ...) with B's stored rows anywhere (row r at rows[r]): the rows copied into one
// aligned tile first, so that equal rows give equal bits wherever they are.
inline void gemm_rows(bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
                      const float* const* rows, float beta, float* c, int64_t ldc) {
  const int64_t count = trans_b ? n : k, width = trans_b ? k : n;
  gr_blas::AlignedFloats tile(count * width);
  for (int64_t r = 0; r < count; ++r) std::copy(rows[r], rows[r] + width, tile.data() + r * width);
  gemm(false, trans_b, m, n, k, alpha, a, lda, tile.data(), std::max<int64_t>(width, 1), beta, c, ldc);
}

#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)

constexpr bool kBf16Instructions = true;

// bf16 math (gemm_bf16): the operands rounded to bf16 (to nearest even) and packed in the layout
// vdpbf16ps reads, a 32-bit word per pair of consecutive k, (k even) in the low half; the products
// summed in fp32. Per k pair one vdpbf16ps does the work of two fp32 FMAs.
constexpr int64_t kPairs = kDepth / 2;   // k pairs per pass
constexpr int64_t kPackedRows = 128;     // rows of A packed at a time

// Word i = the pair (even[i], odd[i]) in bf16.
inline __m512i pair_words(__m512 even, __m512 odd) {
  const __m512i lo = _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(even)));
  const __m512i hi = _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(odd)));
  return _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
}

// The 16 words of 32 consecutive floats from src (first `n` of them, the rest zero): word w = the
// pair (src[2w], src[2w + 1]).
inline __m512i words_of_run(const float* src, int64_t n) {
  const __m512 first = _mm512_maskz_loadu_ps(first_lanes(n), src);
  const __m512 second = _mm512_maskz_loadu_ps(first_lanes(n - 16), src + 16);
  return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(second, first));
}

// dst[i * ldd + p] = the pair (src[i, 2p], src[i, 2p + 1]) for i < n, p < ceil(k / 2): rows of a row-major
// [n, k] (row stride lds), pairs along the rows; an odd k's last pair ends in zero. ldd >= 16 * ceil(k / 32).
inline void pack_rows(int64_t n, int64_t k, const float* src, int64_t lds, uint32_t* dst, int64_t ldd) {
  for (int64_t i = 0; i < n; ++i)
    for (int64_t k0 = 0; k0 < k; k0 += 32)
      _mm512_storeu_si512(dst + i * ldd + k0 / 2, words_of_run(src + i * lds + k0, k - k0));
}

// dst[p * ldd + j] = the pair (src[2p, j], src[2p + 1, j]) for p < ceil(k / 2), j < n rounded up to 16
// (columns past n are zero): pairs of rows of a row-major [k, n] (row stride lds).
inline void pack_row_pairs(int64_t n, int64_t k, const float* src, int64_t lds, uint32_t* dst, int64_t ldd) {
  for (int64_t p = 0; 2 * p < k; ++p) {
    const float* even = src + 2 * p * lds;
    const bool has_odd = 2 * p + 1 < k;
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
      const __mmask16 lanes = first_lanes(n - j0);
      const __m512 x = _mm512_maskz_loadu_ps(lanes, even + j0);
      const __m512 y = has_odd ? _mm512_maskz_loadu_ps(lanes, even + lds + j0) : _mm512_setzero_ps();
      _mm512_storeu_si512(dst + p * ldd + j0, pair_words(x, y));
    }
  }
}

// dst[p * ldd + j] = the pair (src[j, 2p], src[j, 2p + 1]) for p < ceil(k / 2), j < n rounded up to 16:
// pack_row_pairs of the transpose of a row-major [n, k], 16 x 16 words at a time in registers.
inline void pack_transposed_pairs(int64_t n, int64_t k, const float* src, int64_t lds, uint32_t* dst, int64_t ldd) {
  __m512 r[16];
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    for (int64_t k0 = 0; k0 < k; k0 += 32) {
      for (int64_t i = 0; i < 16; ++i)
        r[i] = j0 + i < n ? reinterpret_cast<__m512>(words_of_run(src + (j0 + i) * lds + k0, k - k0))
                          : _mm512_setzero_ps();
      transpose16(r);
      const int64_t pairs = std::min<int64_t>(16, (k - k0 + 1) / 2);
      for (int64_t c = 0; c < pairs; ++c) _mm512_storeu_ps(reinterpret_cast<float*>(dst + (k0 / 2 + c) * ldd + j0), r[c]);
    }
  }
}

// bf16 operands of one register block: A's pair p of row r at a[r * row_stride + p * pair_stride],
// B's column block packed [pairs, kCols] words.
struct Bf16Operands {
  const uint32_t* a;
  int64_t row_stride, pair_stride;
  const uint32_t* panel;
  __mmask16 lo, hi;

  Bf16Operands rows_from(int64_t i0) const { return {a + i0 * row_stride, row_stride, pair_stride, panel, lo, hi}; }
  // acc[r] += sum_k A[r, k] B[k, lanes] for k < depth.
  template <int R, bool kTwo>
  void accumulate(int64_t depth, __m512 acc[R][2]) const {
    for (int64_t p = 0; 2 * p < depth; ++p) {
      const __m512bh b0 = reinterpret_cast<__m512bh>(_mm512_load_si512(panel + p * kCols));
      const __m512bh b1 = reinterpret_cast<__m512bh>(kTwo ? _mm512_load_si512(panel + p * kCols + 16)
                                                          : _mm512_setzero_si512());
      const uint32_t* ap = a + p * pair_stride;
      for (int r = 0; r < R; ++r) {
        const __m512bh x = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(ap[r * row_stride])));
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, b0);
        if constexpr (kTwo) acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, b1);
      }
    }
  }
};

// gemm's contract in bf16 math: op(A) and op(B) rounded to bf16, the sums in fp32 (k ascending in
// pairs within passes of kDepth, so results repeat bitwise). Denormal products and sums are flushed
// to zero, as vdpbf16ps does.
__attribute__((noinline, noclone)) inline void gemm_bf16(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                                                         float alpha, const float* a, int64_t lda, const float* b,
                                                         int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m <= 0 || n <= 0 || k <= 0) return gemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  alignas(64) uint32_t panel[kPairs * kCols];
  alignas(64) uint32_t packed[kPackedRows * kPairs];
  for (int64_t k0 = 0; k0 < k; k0 += kDepth) {
    const int64_t depth = std::min(kDepth, k - k0);
    for (int64_t i1 = 0; i1 < m; i1 += kPackedRows) {
      const int64_t rows = std::min(kPackedRows, m - i1);
      Bf16Operands x{packed, kPairs, 1, panel, 0, 0};
      if (trans_a) {  // A is stored [K, M]
        pack_row_pairs(rows, depth, a + k0 * lda + i1, lda, packed, kPackedRows);
        x.row_stride = 1;
        x.pair_stride = kPackedRows;
      } else {
        pack_rows(rows, depth, a + i1 * lda + k0, lda, packed, kPairs);
      }
      for (int64_t j0 = 0; j0 < n; j0 += kCols) {
        const int64_t cols = std::min(kCols, n - j0);
        if (trans_b)  // B is stored [N, K]
          pack_transposed_pairs(cols, depth, b + j0 * ldb + k0, ldb, panel, kCols);
        else
          pack_row_pairs(cols, depth, b + k0 * ldb + j0, ldb, panel, kCols);
        x.lo = first_lanes(cols);
        x.hi = first_lanes(cols - 16);
        column_block(rows, cols, depth, alpha, x, beta, k0 == 0, c + i1 * ldc + j0, ldc);
      }
    }
  }
}

#else  // no bf16 instructions in this build: fp32 math, which bf16 math's tolerances admit

constexpr bool kBf16Instructions = false;

inline void gemm_bf16(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                      int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  gemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

#endif

// gemm's signature; gemm_for(bf16): the kernels' GEMM in bf16 math when asked, else fp32.
using Gemm = void (*)(bool, bool, int64_t, int64_t, int64_t, float, const float*, int64_t, const float*, int64_t, float,
                      float*, int64_t);
inline Gemm gemm_for(bool bf16) { return bf16 ? gemm_bf16 : gemm; }

}  // namespace gr_gemm
