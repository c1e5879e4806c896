// Group-affine rows on AVX2 + FMA + F16C for the bf16-activation linears: y[M, N] = x[M, K] (bf16)
// . W[N, K]^T, fp32 out, with
//     W[n, k] = scale[n, g] * (code[n, k] - offset) + minimum[n, g]      g = k / group (16 or 32)
// Every x86 ISA path has these (the AVX-512 module includes this file too, its functions marked for
// AVX2 themselves). The int4 linear of GGUF Q4_1 / Q4_0 blocks on AVX2 is this kernel (4-bit codes
// in the nibble-pair layout of common.h, group 32, the scales and minimums read from their fp16
// table: F16PairScales); the scale policies (GroupScales) serve the int8-activation kernels of the
// other GGUF families too (q8act.h).
//
// Activations are widened to fp32 (exact), the codes converted to fp32 less the offset (exact small
// integers), and for every output element the order of operations is fixed: per group two partial
// dot products (even and odd inputs, in input order), their sum times the group's scale added to the
// accumulator, then the minimum times the sum of the group's inputs:
//     acc = minimum * sum(x_g) + ((d_even + d_odd) * scale + acc)
// A column block's codes are converted once per call and serve every row (in registers for up to 3
// rows, through a per-thread fp32 tile for more); a row's arithmetic is the same whichever tile or
// path computes it, so a row's bits never depend on how many rows share the call.
#pragma once

#include "common.h"

namespace draftwise {

#define DW_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace affine {

constexpr int MT_MAX = 3;       // rows per register tile

// bf16 [n] -> fp32 (exact)
DW_AVX2 inline void widen_bf16(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))), 16)));
  for (; i < n; ++i) dst[i] = from_bf16(src[i]);
}

// the 8 lanes of v summed in a fixed order: (lo + hi) halves, then pairs
DW_AVX2 inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// per group of `group` (16 or 32) fp32 inputs: their sum, in a fixed order
DW_AVX2 inline void group_sums(const float* x, int K, int group, float* out) {
  for (int g = 0; g < K / group; ++g) {
    const float* p = x + g * group;
    __m256 a = _mm256_add_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8));
    if (group == 32) a = _mm256_add_ps(a, _mm256_add_ps(_mm256_loadu_ps(p + 16), _mm256_loadu_ps(p + 24)));
    out[g] = hsum8(a);
  }
}

// Where a column block's per-group scales and minimums come from (8 lanes: columns h*8 .. h*8+7):
// F32Scales: scale [blocks][G][16] fp32, minimum the same or none (the affine layout);
// F16Scales: the same in fp16, where every value is exact in it (Q5_0, Q5_1, Q8_0, IQ4_NL: the
// blocks' own fp16 numbers, at half the bytes);
// F16PairScales: sm fp16 [blocks][G][2][16], the group's 16 scales then its 16 minimums (the int4
// layout of GGUF Q4_1 blocks: both exact in fp16).

// 8 scales from a table: fp32, or fp16 bits widened (exact)
DW_AVX2 inline __m256 scales8(const float* p) { return _mm256_loadu_ps(p); }
DW_AVX2 inline __m256 scales8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

template <typename T>
struct GroupScales {
  const T* s;
  const T* m;
  int G;
  GroupScales at(int64_t b) const { return {s + b * G * NB, m ? m + b * G * NB : nullptr, G}; }
  bool has_min() const { return m != nullptr; }
  DW_AVX2 __m256 scale(int g, int h) const { return scales8(s + g * NB + h * 8); }
  DW_AVX2 __m256 min(int g, int h) const { return scales8(m + g * NB + h * 8); }
};
using F32Scales = GroupScales<float>;
using F16Scales = GroupScales<uint16_t>;    // fp16 bits

struct F16PairScales {
  const uint16_t* sm;
  int G;
  F16PairScales at(int64_t b) const { return {sm + b * G * 2 * NB, G}; }
  bool has_min() const { return true; }
  DW_AVX2 __m256 scale(int g, int h) const { return scales8(sm + g * 2 * NB + h * 8); }
  DW_AVX2 __m256 min(int g, int h) const { return scales8(sm + g * 2 * NB + NB + h * 8); }
};

// pair p's codes less the offset as fp32: w[0], w[1] = input 2p (columns 0-7, 8-15), w[2], w[3] = 2p + 1
struct Nibbles {
  using T = uint8_t;
  static constexpr int64_t bytes_per_pair = NB;
  DW_AVX2 static inline void unpack(const uint8_t* pk, __m256i off, __m256 w[4]) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(pk));
    const __m256i lo = _mm256_cvtepu8_epi32(b), hi = _mm256_cvtepu8_epi32(_mm_unpackhi_epi64(b, b));
    const __m256i m = _mm256_set1_epi32(15);
    w[0] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(lo, m), off));
    w[1] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(hi, m), off));
    w[2] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(lo, 4), off));
    w[3] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(hi, 4), off));
  }
};

// a column block's codes, all pairs, as fp32 [K/2][4][8]
template <typename C>
DW_AVX2 void unpack_block(const typename C::T* pk, int K, __m256i off, float* tile) {
  __m256 w[4];
  for (int p = 0; p < K / 2; ++p) {
    prefetch_weights(pk + p * C::bytes_per_pair + PREFETCH_BYTES);
    C::unpack(pk + p * C::bytes_per_pair, off, w);
    for (int i = 0; i < 4; ++i) _mm256_store_ps(tile + p * 32 + i * 8, w[i]);
  }
}

// MT rows of one column block (the order of operations in the file's comment); the codes from
// `tile` (TILE) or unpacked from `pk` in registers; `sc` this block's scales.
template <typename C, typename S, int MT, bool TILE>
DW_AVX2 void rows(const float* x, const float* xs, int K, int group, const typename C::T* pk, __m256i off,
                  const float* tile, const S& sc, float* y, int N) {
  const int G = K / group, P = group / 2;
  __m256 acc[MT][2];
  for (int r = 0; r < MT; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int g = 0; g < G; ++g) {
    __m256 d0[MT][2], d1[MT][2];
    for (int r = 0; r < MT; ++r) d0[r][0] = d0[r][1] = d1[r][0] = d1[r][1] = _mm256_setzero_ps();
    for (int q = 0; q < P; ++q) {
      const int p = g * P + q;
      __m256 w[4];
      if (TILE) {
        for (int i = 0; i < 4; ++i) w[i] = _mm256_load_ps(tile + p * 32 + i * 8);
      } else {
        if ((q & 3) == 0)
          prefetch_weights(pk + p * C::bytes_per_pair + PREFETCH_BYTES);
        C::unpack(pk + p * C::bytes_per_pair, off, w);
      }
      for (int r = 0; r < MT; ++r) {
        const __m256 xa = _mm256_broadcast_ss(x + r * K + 2 * p), xb = _mm256_broadcast_ss(x + r * K + 2 * p + 1);
        d0[r][0] = _mm256_fmadd_ps(xa, w[0], d0[r][0]);
        d0[r][1] = _mm256_fmadd_ps(xa, w[1], d0[r][1]);
        d1[r][0] = _mm256_fmadd_ps(xb, w[2], d1[r][0]);
        d1[r][1] = _mm256_fmadd_ps(xb, w[3], d1[r][1]);
      }
    }
    const __m256 s[2] = {sc.scale(g, 0), sc.scale(g, 1)};
    for (int r = 0; r < MT; ++r)
      for (int h = 0; h < 2; ++h) acc[r][h] = _mm256_fmadd_ps(_mm256_add_ps(d0[r][h], d1[r][h]), s[h], acc[r][h]);
    if (sc.has_min()) {
      const __m256 m[2] = {sc.min(g, 0), sc.min(g, 1)};
      for (int r = 0; r < MT; ++r) {
        const __m256 xsum = _mm256_set1_ps(xs[r * G + g]);
        for (int h = 0; h < 2; ++h) acc[r][h] = _mm256_fmadd_ps(m[h], xsum, acc[r][h]);
      }
    }
  }
  for (int r = 0; r < MT; ++r) {
    _mm256_storeu_ps(y + static_cast<int64_t>(r) * N, acc[r][0]);
    _mm256_storeu_ps(y + static_cast<int64_t>(r) * N + 8, acc[r][1]);
  }
}

template <typename C, typename S, bool TILE>
DW_AVX2 void rows_any(int mt, const float* x, const float* xs, int K, int group, const typename C::T* pk,
                      __m256i off, const float* tile, const S& sc, float* y, int N) {
  switch (mt) {
    case 1: rows<C, S, 1, TILE>(x, xs, K, group, pk, off, tile, sc, y, N); break;
    case 2: rows<C, S, 2, TILE>(x, xs, K, group, pk, off, tile, sc, y, N); break;
    case 3: rows<C, S, 3, TILE>(x, xs, K, group, pk, off, tile, sc, y, N); break;
    default: break;
  }
}

// column blocks [b0, b1) of the output, every row (one thread's share)
template <typename C, typename S>
DW_AVX2 void column_blocks(int64_t b0, int64_t b1, const float* xf, const float* xs, int M, int K, int group,
                           const typename C::T* codes, int offset, const S& scales, int N, float* y) {
  const int G = K / group;
  const int64_t block_codes = static_cast<int64_t>(K / 2) * C::bytes_per_pair;
  const __m256i off = _mm256_set1_epi32(offset);
  std::unique_ptr<Aligned<float>> tile;
  if (M > MT_MAX) tile = std::make_unique<Aligned<float>>(static_cast<size_t>(K) * NB);
  for (int64_t b = b0; b < b1; ++b) {
    const typename C::T* pkb = codes + b * block_codes;
    const S sc = scales.at(b);
    if (!tile) {
      rows_any<C, S, false>(M, xf, xs, K, group, pkb, off, nullptr, sc, y + b * NB, N);
      continue;
    }
    unpack_block<C>(pkb, K, off, tile->p);
    for (int m0 = 0; m0 < M; m0 += MT_MAX)
      rows_any<C, S, true>(std::min(MT_MAX, M - m0), xf + static_cast<int64_t>(m0) * K, xs + m0 * G, K, group, pkb,
                           off, tile->p, sc, y + static_cast<int64_t>(m0) * N + b * NB, N);
  }
}

// y [M, N] = x . W^T: x bf16 rows widened to fp32 and their group sums, then the column blocks in
// parallel (the codes C, the scales S)
template <typename C, typename S>
torch::Tensor linear(const torch::Tensor& x, int group, const typename C::T* codes, int offset, const S& scales,
                     int64_t blocks) {
  const int M = x.size(0), K = x.size(1), G = K / group;
  const int N = static_cast<int>(blocks * NB);
  auto y = new_empty({M, N}, x.options().dtype(torch::kFloat));
  if (M == 0) return y;
  std::vector<float> xf(static_cast<size_t>(M) * K), xs(static_cast<size_t>(M) * G);
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  for_rows(M, [&](int64_t r) {
    widen_bf16(xp + r * K, xf.data() + r * K, K);
    group_sums(xf.data() + r * K, K, group, xs.data() + r * G);
  });
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    column_blocks<C, S>(b0, b1, xf.data(), xs.data(), M, K, group, codes, offset, scales, N, yp);
  });
  return y;
}

}  // namespace affine

inline const uint16_t* half_ptr(const torch::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<at::Half>());
}

}  // namespace draftwise
