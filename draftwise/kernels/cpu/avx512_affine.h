// The group-affine linear (draftwise/formats: every GGUF block family) on AVX512-BF16 dot products:
// y[M, N] = x[M, K] (bf16) . W[N, K]^T, fp32 out, W = scale * (code - offset) + minimum per group
// of 16 or 32 inputs (layouts: affine.h).
//
// Each column block's codes, less the offset, are converted once per call into a bf16 tile in the
// pair layout the dot-product instruction reads (for k-pair p: 16 columns x (w[., 2p], w[., 2p+1]));
// the codes are integers in [-136, 127], exact in bf16. The tile then serves every row: per group
// two partial dot products (even and odd k-pairs, _mm512_dpbf16_ps), then
//     acc = minimum * sum(x_g) + ((d_even + d_odd) * scale + acc)
// in the same order for every row, whatever the number of rows in the call (rows are tiled 16 at a
// time and each accumulates alone), so a row's bits never depend on the rows beside it.
// The int4 linear of GGUF Q4_1 blocks and the per-channel int8 linear (avx512.cpp) run their rows
// here too (their scales through their own scale16 / min16 overloads).
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

// 16 columns' codes for inputs 2p (even) and 2p + 1 (odd) as int32 lanes -> one 64-byte pair row:
// dword j = bf16(even[j] - off) | bf16(odd[j] - off) << 16 (exact: small integers)
AVX512BF16 inline void store_pair(__m512i even, __m512i odd, __m512i off, uint16_t* out) {
  const __m512i e = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_sub_epi32(even, off)));
  const __m512i o = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_sub_epi32(odd, off)));
  // e >> 16 in the low word, o's high word kept: (e >> 16) | (o & 0xFFFF0000)
  _mm512_store_si512(out, _mm512_ternarylogic_epi32(_mm512_srli_epi32(e, 16), o, _mm512_set1_epi32(0xFFFF0000), 0xF8));
}

AVX512BF16 void unpack_nibbles(const uint8_t* pk, int K, int offset, uint16_t* Q) {
  const __m512i off = _mm512_set1_epi32(offset), m = _mm512_set1_epi32(15);
  for (int p = 0; p < K / 2; ++p) {
    _mm_prefetch(reinterpret_cast<const char*>(pk + p * NB + PREFETCH_BYTES), _MM_HINT_T0);
    const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pk + p * NB)));
    store_pair(_mm512_and_si512(d, m), _mm512_srli_epi32(d, 4), off, Q + p * 32);
  }
}

// 5-bit codes (affine.h's layout): the nibbles as unpack_nibbles; the pair's word of high bits is
// two lane masks (16 columns of input 2p, then of 2p + 1): 16 added where a mask bit is set
AVX512BF16 void unpack_nibbles5(const uint8_t* pk, int K, int offset, uint16_t* Q) {
  const __m512i off = _mm512_set1_epi32(offset), m = _mm512_set1_epi32(15), sixteen = _mm512_set1_epi32(16);
  for (int p = 0; p < K / 2; ++p) {
    const uint8_t* q = pk + p * (NB + 4);
    _mm_prefetch(reinterpret_cast<const char*>(q + PREFETCH_BYTES), _MM_HINT_T0);
    const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    uint32_t word;
    std::memcpy(&word, q + NB, 4);
    const __m512i even = _mm512_and_si512(d, m), odd = _mm512_srli_epi32(d, 4);
    store_pair(_mm512_mask_or_epi32(even, static_cast<__mmask16>(word), even, sixteen),
               _mm512_mask_or_epi32(odd, static_cast<__mmask16>(word >> 16), odd, sixteen), off, Q + p * 32);
  }
}

AVX512BF16 void unpack_int8(const int8_t* q, int K, int offset, uint16_t* Q) {
  const __m512i off = _mm512_set1_epi32(offset);
  for (int p = 0; p < K / 2; ++p) {
    _mm_prefetch(reinterpret_cast<const char*>(q + p * 2 * NB + PREFETCH_BYTES), _MM_HINT_T0);
    const __m512i e = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + p * 2 * NB)));
    const __m512i o = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + p * 2 * NB + NB)));
    store_pair(e, o, off, Q + p * 32);
  }
}

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

inline torch::Tensor affine_linear(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale,
                                   const torch::Tensor& minimum, int64_t group, int64_t offset) {
  check_affine(x, codes, scale, minimum, group);
  const bool nib = codes.scalar_type() == torch::kByte;
  const int M = x.size(0), K = x.size(1), gs = static_cast<int>(group), G = K / gs;
  const int64_t blocks = codes.size(0), N = blocks * NB;
  auto y = at::empty({M, N}, x.options().dtype(torch::kFloat));
  if (M == 0) return y;
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  std::vector<float> xs(static_cast<size_t>(M) * G);
  for_rows(M, [&](int64_t r) { affine512::group_sums(xp + r * K, K, gs, xs.data() + r * G); });
  float* yp = y.data_ptr<float>();
  const bool five = nib && codes.size(2) == NB + 4;
  const int64_t block_codes = static_cast<int64_t>(nib ? K / 2 : K) * codes.size(2);
  const bool has_min = minimum.numel() > 0;
  auto run = [&](const auto& scales) {
    at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
      Aligned<uint16_t> tile(static_cast<size_t>(K) * NB);
      for (int64_t b = b0; b < b1; ++b) {
        if (five)
          affine512::unpack_nibbles5(codes.data_ptr<uint8_t>() + b * block_codes, K, static_cast<int>(offset), tile.p);
        else if (nib)
          affine512::unpack_nibbles(codes.data_ptr<uint8_t>() + b * block_codes, K, static_cast<int>(offset), tile.p);
        else
          affine512::unpack_int8(codes.data_ptr<int8_t>() + b * block_codes, K, static_cast<int>(offset), tile.p);
        const auto sc = scales.at(b);
        for (int m0 = 0; m0 < M; m0 += 16)
          affine512::rows_any(std::min(16, M - m0), xp + static_cast<int64_t>(m0) * K, xs.data() + m0 * G, K, gs,
                              tile.p, sc, yp + static_cast<int64_t>(m0) * N + b * NB, static_cast<int>(N));
      }
    });
  };
  if (scale.scalar_type() == torch::kHalf)
    run(F16Scales{half_ptr(scale), has_min ? half_ptr(minimum) : nullptr, G});
  else
    run(F32Scales{scale.data_ptr<float>(), has_min ? minimum.data_ptr<float>() : nullptr, G});
  return y;
}

}  // namespace draftwise
