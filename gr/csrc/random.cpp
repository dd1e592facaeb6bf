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

namespace {

using at::Tensor;

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;

inline uint64_t splitmix64(uint64_t seed, uint64_t i) {
  uint64_t z = seed + (i + 1) * kGolden;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// -> [n] uint8: 1 with probability 1 - p (the top 32 bits of a draw >= p * 2^32), else 0.
Tensor keep_mask(int64_t n, double p, int64_t seed) {
  TORCH_CHECK(n >= 0 && p >= 0.0 && p < 1.0, "gr_cpu_random.keep_mask: expected n >= 0 and 0 <= p < 1");
  Tensor mask = at::empty({n}, at::TensorOptions().dtype(at::kByte));
  uint8_t* out = mask.data_ptr<uint8_t>();
  const uint64_t threshold = static_cast<uint64_t>(p * 4294967296.0);
  const uint64_t s = static_cast<uint64_t>(seed);
  at::parallel_for(0, n, 1 << 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) out[i] = (splitmix64(s, i) >> 32) >= threshold;
  });
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
