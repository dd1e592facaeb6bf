// Counter-based random numbers for CPU training: dropout keep masks and uniform integer draws.
//
// Draw i of a call is SplitMix64(seed + (i + 1) * golden), i.e. the i-th output of the SplitMix64
// generator (Steele et al. 2014; passes BigCrush) started at `seed`. Each draw is independent of the
// others, so the loops vectorise and split across threads, and the result depends only on (seed, i):
// the same on any number of threads. The callers draw `seed` from a torch generator, so
// torch.manual_seed and Lightning's seed_everything still make a run repeatable.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define GR_RANDOM_AVX512 1
#endif

namespace {

using at::Tensor;

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;

inline uint64_t splitmix64(uint64_t seed, uint64_t i) {
  uint64_t z = seed + (i + 1) * kGolden;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

#if defined(GR_RANDOM_AVX512)
// splitmix64's output mix of 8 states z = seed + (i + 1) * golden at once (64-bit lane multiplies).
inline __m512i splitmix64_mix(__m512i z) {
  z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 30)), _mm512_set1_epi64(0xBF58476D1CE4E5B9ull));
  z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 27)), _mm512_set1_epi64(0x94D049BB133111EBull));
  return _mm512_xor_si512(z, _mm512_srli_epi64(z, 31));
}
#endif

// out[i] = (splitmix64(seed, i) >> 32) >= threshold for i in [begin, end), 8 draws a vector where the
// build has AVX-512, then one at a time.
void keep_bytes(uint64_t seed, uint64_t threshold, int64_t begin, int64_t end, uint8_t* out) {
  int64_t i = begin;
#if defined(GR_RANDOM_AVX512)
  const __m512i step = _mm512_set1_epi64(8 * kGolden), limit = _mm512_set1_epi64(threshold);
  const __m128i ones = _mm_set1_epi8(1);
  __m512i z = _mm512_add_epi64(_mm512_set1_epi64(seed + (begin + 1) * kGolden),
                               _mm512_mullo_epi64(_mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7), _mm512_set1_epi64(kGolden)));
  for (; i + 8 <= end; i += 8, z = _mm512_add_epi64(z, step)) {
    const __mmask8 keep = _mm512_cmpge_epu64_mask(_mm512_srli_epi64(splitmix64_mix(z), 32), limit);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out + i), _mm_maskz_mov_epi8(keep, ones));
  }
#endif
  for (; i < end; ++i) out[i] = (splitmix64(seed, i) >> 32) >= threshold;
}

// -> [n] uint8: 1 with probability 1 - p (the top 32 bits of a draw >= p * 2^32), else 0.
Tensor keep_mask(int64_t n, double p, int64_t seed) {
  TORCH_CHECK(n >= 0 && p >= 0.0 && p < 1.0, "gr_cpu_random.keep_mask: expected n >= 0 and 0 <= p < 1");
  Tensor mask = at::empty({n}, at::TensorOptions().dtype(at::kByte));
  uint8_t* out = mask.data_ptr<uint8_t>();
  const uint64_t threshold = static_cast<uint64_t>(p * 4294967296.0);
  const uint64_t s = static_cast<uint64_t>(seed);
  at::parallel_for(0, n, 1 << 16, [&](int64_t begin, int64_t end) { keep_bytes(s, threshold, begin, end, out); });
  return mask;
}

// -> [n] int64 in [0, high): the top 32 bits of a draw times high, over 2^32 (Lemire's multiply-shift;
// its bias, at most high / 2^32 per value, is the same order as torch.randint's modulo).
Tensor randint(int64_t n, int64_t high, int64_t seed) {
  TORCH_CHECK(n >= 0 && high > 0 && high <= (int64_t{1} << 32),
              "gr_cpu_random.randint: expected n >= 0 and 0 < high <= 2^32");
  Tensor draws = at::empty({n}, at::TensorOptions().dtype(at::kLong));
  int64_t* out = draws.data_ptr<int64_t>();
  const uint64_t h = static_cast<uint64_t>(high);
  const uint64_t s = static_cast<uint64_t>(seed);
  at::parallel_for(0, n, 1 << 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) out[i] = static_cast<int64_t>(((splitmix64(s, i) >> 32) * h) >> 32);
  });
  return draws;
}

}  // namespace

// No tensor arguments to dispatch on: the kernels are registered with their schemas (catch-all).
TORCH_LIBRARY(gr_cpu_random, m) {
  m.def("keep_mask(int n, float p, int seed) -> Tensor", &keep_mask);
  m.def("randint(int n, int high, int seed) -> Tensor", &randint);
}
