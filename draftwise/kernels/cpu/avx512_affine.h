// Group-affine rows on AVX512-BF16 dot products for the bf16-activation linears: the int4 linear of
// GGUF Q4_1 / Q4_0 blocks and the per-channel int8 linear (avx512.cpp), y[M, N] = x[M, K] (bf16) .
// W[N, K]^T, fp32 out, W = scale * (code - offset) + minimum per group.
//
// The caller converts a column block's codes, less the offset, once per call into a bf16 tile in the
// pair layout the dot-product instruction reads (for k-pair p: 16 columns x (w[., 2p], w[., 2p+1]));
// the tile then serves every row: per group two partial dot products (even and odd k-pairs,
// _mm512_dpbf16_ps), then
//     acc = minimum * sum(x_g) + ((d_even + d_odd) * scale + acc)
// in the same order for every row, whatever the number of rows in the call (rows are tiled 16 at a
// time and each accumulates alone), so a row's bits never depend on the rows beside it. (The other
// GGUF families run on int8 activations: avx512_q8act.h.)
#pragma once

#include "affine.h"

#define AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

namespace draftwise {

using affine::F16Scales;
using affine::F32Scales;

namespace affine512 {

// a column block's 16 scales / minimums of group g from affine.h's GroupScales (fp32 or fp16; with
// G = 1 and group = K an F32Scales holds one scale per output channel: the int8 linear)
AVX512BF16 inline __m512 scales16(const float* p) { return _mm512_loadu_ps(p); }
AVX512BF16 inline __m512 scales16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
template <typename T>
AVX512BF16 inline __m512 scale16(const affine::GroupScales<T>& sc, int g) { return scales16(sc.s + g * NB); }
template <typename T>
AVX512BF16 inline __m512 min16(const affine::GroupScales<T>& sc, int g) { return scales16(sc.m + g * NB); }

// per group of 16 or 32 bf16 inputs: their sum in fp32, in a fixed order (for 32: the two 16-lane
// halves added, then the lanes reduced)
AVX512BF16 void group_sums(const uint16_t* x, int K, int group, float* out) {
  for (int g = 0; g < K / group; ++g) {
    const uint16_t* p = x + g * group;
    __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
    if (group == 32)
      v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16))), 16)));
    out[g] = _mm512_reduce_add_ps(v);
  }
}

// MT rows of one column block from its bf16 tile Q; `sc` the block's scales (a policy)
template <int MT, typename S>
AVX512BF16 void rows(const uint16_t* x, const float* xs, int K, int group, const uint16_t* Q, const S& sc, float* y,
                     int N) {
  __m512 acc[MT];
#pragma GCC unroll 16
  for (int r = 0; r < MT; ++r) acc[r] = _mm512_setzero_ps();
  const int G = K / group, P = group / 2;
  for (int g = 0; g < G; ++g) {
    __m512 d0[MT], d1[MT];
#pragma GCC unroll 16
    for (int r = 0; r < MT; ++r) { d0[r] = _mm512_setzero_ps(); d1[r] = _mm512_setzero_ps(); }
    for (int q = 0; q < P; q += 2) {
      const int p = g * P + q;
      const __m512bh b0 = (__m512bh)_mm512_load_si512(Q + p * 32);
      const __m512bh b1 = (__m512bh)_mm512_load_si512(Q + (p + 1) * 32);
#pragma GCC unroll 16
      for (int r = 0; r < MT; ++r) {
        const int32_t* xr = reinterpret_cast<const int32_t*>(x + static_cast<int64_t>(r) * K);
        d0[r] = _mm512_dpbf16_ps(d0[r], (__m512bh)_mm512_set1_epi32(xr[p]), b0);
        d1[r] = _mm512_dpbf16_ps(d1[r], (__m512bh)_mm512_set1_epi32(xr[p + 1]), b1);
      }
    }
    const __m512 s = scale16(sc, g);
#pragma GCC unroll 16
    for (int r = 0; r < MT; ++r) acc[r] = _mm512_fmadd_ps(_mm512_add_ps(d0[r], d1[r]), s, acc[r]);
    if (sc.has_min()) {
      const __m512 m = min16(sc, g);
#pragma GCC unroll 16
      for (int r = 0; r < MT; ++r) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[r * G + g]), acc[r]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < MT; ++r) _mm512_storeu_ps(y + static_cast<int64_t>(r) * N, acc[r]);
}

template <typename S>
AVX512BF16 void rows_any(int mt, const uint16_t* x, const float* xs, int K, int group, const uint16_t* Q, const S& sc,
                         float* y, int N) {
  switch (mt) {
#define CASE(n) case n: rows<n, S>(x, xs, K, group, Q, sc, y, N); break;
    CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
    CASE(9) CASE(10) CASE(11) CASE(12) CASE(13) CASE(14) CASE(15) CASE(16)
#undef CASE
    default: break;
  }
}

}  // namespace affine512

}  // namespace draftwise
