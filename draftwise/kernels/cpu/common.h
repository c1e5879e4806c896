// What every ISA's kernels share: the packed layouts' constants, the row loop, scalar bf16 rounding.
//
// Packed int4 layout (made by draftwise/kernels/__init__.py from codes [N, K], scale and minimum):
//   nibbles: uint8 [N/16, K/2, 16], byte j of pair p = code[n0+j][2p] | code[n0+j][2p+1] << 4
//   sm:      fp16 [N/16, K/32, 2, 16]: the group's 16 scales, then its 16 minimums (GGUF Q4_1 stores
//            both in fp16: exact)
// Packed int8 layout (per output channel): q8 int8 [N/16, K/2, 16, 2] (pairs), scale fp32 [N].
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/python.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

namespace draftwise {

constexpr int NB = 16;   // output columns per block
constexpr int GROUP = 32;
constexpr int PAIRS = GROUP / 2;
// software prefetch distance of the weight streams: 2 KB (~ DRAM latency x one core's bandwidth);
// measured on SmolLM2's LM head at one row: 6.3 ms with none, 4.2 at 512 B, 3.3 at 2 KB (1 thread)
constexpr int PREFETCH_BYTES = 2048;

// rows [0, M) in parallel chunks of at least ROW_GRAIN rows (fewer run on the calling thread); each
// row's arithmetic is the same whichever thread does it
constexpr int64_t ROW_GRAIN = 8;
template <typename F>
void for_rows(int64_t M, const F& f) {
  at::parallel_for(0, M, ROW_GRAIN, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) f(r);
  });
}

// fp32 -> bf16, round to nearest even (as at::BFloat16's conversion; inputs are finite)
inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float from_bf16(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// an aligned scratch buffer (64 bytes), freed with its scope
template <typename T>
struct Aligned {
  T* p;
  explicit Aligned(size_t n) : p(static_cast<T*>(std::aligned_alloc(64, ((n * sizeof(T) + 63) / 64) * 64))) {}
  ~Aligned() { std::free(p); }
  Aligned(const Aligned&) = delete;
  Aligned& operator=(const Aligned&) = delete;
};

inline void check_int4(const torch::Tensor& x, const torch::Tensor& nibbles, const torch::Tensor& sm) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.is_contiguous(), "x: contiguous bf16 [M, K]");
  TORCH_CHECK(nibbles.dim() == 3 && nibbles.size(2) == NB && nibbles.scalar_type() == torch::kUInt8, "nibbles layout");
  TORCH_CHECK(nibbles.size(1) * 2 == x.size(1) && x.size(1) % GROUP == 0, "K mismatch");
  TORCH_CHECK(sm.scalar_type() == torch::kHalf && sm.is_contiguous(), "sm: contiguous fp16");
}

inline void check_int8(const torch::Tensor& x, const torch::Tensor& q8, const torch::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.is_contiguous(), "x: contiguous bf16 [M, K]");
  TORCH_CHECK(q8.dim() == 4 && q8.size(2) == NB && q8.size(3) == 2 && q8.scalar_type() == torch::kChar, "q8 layout");
  TORCH_CHECK(q8.size(1) * 2 == x.size(1) && x.size(1) % GROUP == 0, "K mismatch");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat && scale.numel() == q8.size(0) * NB, "scale: float [N]");
}

}  // namespace draftwise
