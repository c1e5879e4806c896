// The int8-activation group-affine linear (q8act.h: layouts, order of operations) on AVX2:
// vpmaddubsw multiplies 32 unsigned code bytes by 32 signed activation bytes and adds adjacent
// pairs to int16, vpmaddwd with ones adds those pairs to int32: per 256-bit vector 8 columns x 4
// inputs. A column block is run as two halves of 8 columns (bytes 0-31 and 32-63 of each 64-byte
// step). Products stay inside int16: 4- to 6-bit codes (at most 63 x 127 x 2 per pair; an octet's
// two pairs summed: 32,004); int8 codes use the sign trick (|code| x activation with the code's sign:
// 128 x 127 x 2 = 32,512), so they need no offset.
#pragma once

#include "q8act.h"

namespace draftwise {
namespace q8act256 {

constexpr int MT_MAX = 4;      // rows per register tile

// half h's codes of the octet step at p as two unsigned byte vectors, a = inputs 0-3 of its 8
// columns, b = inputs 4-7 (4- to 6-bit codes: the nibbles, then the high bits in the shifts
// arrangement, q8act.h), or as signed bytes (8-bit codes)
template <int BITS>
DW_AVX2 inline void load_half(const uint8_t* p, int h, __m256i& a, __m256i& b) {
  if constexpr (BITS == 8) {
    a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + h * 32));
    b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 + h * 32));
  } else {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + h * 32)), m = _mm256_set1_epi8(15);
    a = _mm256_and_si256(v, m);
    b = _mm256_and_si256(_mm256_srli_epi16(v, 4), m);
    if constexpr (BITS == 6) {
      // byte u's crumbs: a0, b0, a1, b1 (bits 0-1, 2-3, 4-5, 6-7) moved to bits 4-5 (16-bit shifts:
      // what crosses a byte edge is masked off)
      const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64)), m2 = _mm256_set1_epi8(0x30);
      if (h == 0) {
        a = _mm256_or_si256(a, _mm256_and_si256(_mm256_slli_epi16(c, 4), m2));
        b = _mm256_or_si256(b, _mm256_and_si256(_mm256_slli_epi16(c, 2), m2));
      } else {
        a = _mm256_or_si256(a, _mm256_and_si256(c, m2));
        b = _mm256_or_si256(b, _mm256_and_si256(_mm256_srli_epi16(c, 2), m2));
      }
    } else if constexpr (BITS == 5) {
      // 16 bytes in both lanes; byte u of a_h / b_h has bit 2 (2h + s) + lane: moved to bit 4 by a
      // per-lane shift of the 32-bit words (no bit it keeps crosses a byte)
      const __m256i c = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 64)));
      const __m256i m1 = _mm256_set1_epi8(0x10);
      if (h == 0) {
        a = _mm256_or_si256(a, _mm256_and_si256(_mm256_sllv_epi32(c, _mm256_setr_epi32(4, 4, 4, 4, 3, 3, 3, 3)), m1));
        b = _mm256_or_si256(b, _mm256_and_si256(_mm256_sllv_epi32(c, _mm256_setr_epi32(2, 2, 2, 2, 1, 1, 1, 1)), m1));
      } else {
        a = _mm256_or_si256(a, _mm256_and_si256(_mm256_srlv_epi32(c, _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1)), m1));
        b = _mm256_or_si256(b, _mm256_and_si256(_mm256_srlv_epi32(c, _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3)), m1));
      }
    }
  }
}

template <int BITS>
DW_AVX2 inline __m256i dot_octet(__m256i a, __m256i b, int32_t xa, int32_t xb) {
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i va = _mm256_set1_epi32(xa), vb = _mm256_set1_epi32(xb);
  __m256i pa, pb;
  if constexpr (BITS == 8) {
    pa = _mm256_maddubs_epi16(_mm256_abs_epi8(a), _mm256_sign_epi8(va, a));
    pb = _mm256_maddubs_epi16(_mm256_abs_epi8(b), _mm256_sign_epi8(vb, b));
    return _mm256_add_epi32(_mm256_madd_epi16(pa, ones), _mm256_madd_epi16(pb, ones));
  } else {
    pa = _mm256_maddubs_epi16(a, va);
    pb = _mm256_maddubs_epi16(b, vb);
    return _mm256_madd_epi16(_mm256_add_epi16(pa, pb), ones);
  }
}

// rows r0 .. r0 + MT - 1 of NH half-blocks of 8 columns from half h0: one half (register tiles of up
// to MT_MAX rows), or both halves of a single row in one pass over the codes (each code step loaded
// and prefetched once, each activation word broadcast once: a decode row's linear is a walk through
// the codes with little arithmetic per byte). Each half's arithmetic is the same, in the same order.
template <int BITS, int MT, int NH, typename S>
DW_AVX2 void rows(const q8act::Activations& act, int r0, const uint8_t* pk, int h0, const S& sc, float* y, int64_t N) {
  const int K = act.K, group = act.group, G = act.G, OG = group / q8act::OCTET;
  const int64_t sb = q8act::step_bytes(BITS);
  __m256 acc[MT][NH];
  for (int r = 0; r < MT; ++r)
    for (int h = 0; h < NH; ++h) acc[r][h] = _mm256_setzero_ps();
  const int32_t* xq[MT];
  for (int r = 0; r < MT; ++r) xq[r] = reinterpret_cast<const int32_t*>(act.row(r0 + r));
  for (int g = 0; g < G; ++g) {
    __m256i ia[MT][NH];
    for (int r = 0; r < MT; ++r)
      for (int h = 0; h < NH; ++h) ia[r][h] = _mm256_setzero_si256();
    for (int o = 0; o < OG; ++o) {
      const int oct = g * OG + o;
      q8act::prefetch_step<BITS>(pk + oct * sb, PREFETCH_BYTES);
      __m256i a[NH], b[NH];
      for (int h = 0; h < NH; ++h) load_half<BITS>(pk + oct * sb, h0 + h, a[h], b[h]);
      for (int r = 0; r < MT; ++r) {
        const int32_t xa = xq[r][2 * oct], xb = xq[r][2 * oct + 1];
        for (int h = 0; h < NH; ++h) ia[r][h] = _mm256_add_epi32(ia[r][h], dot_octet<BITS>(a[h], b[h], xa, xb));
      }
    }
    const int db = g * group / q8act::QBLOCK;
    for (int h = 0; h < NH; ++h) {
      const __m256 s = sc.scale(g, h0 + h);
      for (int r = 0; r < MT; ++r) {
        const int rr = r0 + r;
        const __m256i t = _mm256_sub_epi32(ia[r][h], _mm256_set1_epi32(act.corr[rr * G + g]));
        const __m256 sd = _mm256_mul_ps(s, _mm256_set1_ps(act.d[rr * (K / q8act::QBLOCK) + db]));
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), sd, acc[r][h]);
      }
    }
    if (sc.has_min()) {
      for (int h = 0; h < NH; ++h) {
        const __m256 m = sc.min(g, h0 + h);
        for (int r = 0; r < MT; ++r)
          acc[r][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(act.xs[(r0 + r) * G + g]), acc[r][h]);
      }
    }
  }
  for (int r = 0; r < MT; ++r)
    for (int h = 0; h < NH; ++h) _mm256_storeu_ps(y + static_cast<int64_t>(r) * N + (h0 + h) * 8, acc[r][h]);
}

template <int BITS, typename S>
DW_AVX2 void rows_any(int mt, const q8act::Activations& act, int r0, const uint8_t* pk, int h, const S& sc, float* y,
                      int64_t N) {
  switch (mt) {
    case 1: rows<BITS, 1, 1, S>(act, r0, pk, h, sc, y, N); break;
    case 2: rows<BITS, 2, 1, S>(act, r0, pk, h, sc, y, N); break;
    case 3: rows<BITS, 3, 1, S>(act, r0, pk, h, sc, y, N); break;
    case 4: rows<BITS, 4, 1, S>(act, r0, pk, h, sc, y, N); break;
    default: break;
  }
}

template <int BITS, typename S>
void column_blocks(const q8act::Activations& act, const uint8_t* codes, const S& scales, int64_t blocks, float* y) {
  const int M = act.M;
  const int64_t N = blocks * NB, block_bytes = static_cast<int64_t>(act.K / q8act::OCTET) * q8act::step_bytes(BITS);
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int c0 = 0; c0 < M; c0 += q8act::ROW_CHUNK) {
      const int c1 = std::min(M, c0 + q8act::ROW_CHUNK);
      for (int64_t b = b0; b < b1; ++b) {
        const S sc = scales.at(b);
        if (c1 - c0 == 1) {            // one row: both halves in one pass
          rows<BITS, 1, 2, S>(act, c0, codes + b * block_bytes, 0, sc, y + static_cast<int64_t>(c0) * N + b * NB, N);
          continue;
        }
        for (int h = 0; h < 2; ++h)
          for (int r = c0; r < c1; r += MT_MAX)
            rows_any<BITS, S>(std::min(MT_MAX, c1 - r), act, r, codes + b * block_bytes, h, sc,
                              y + static_cast<int64_t>(r) * N + b * NB, N);
      }
    }
  });
}

}  // namespace q8act256

// y [M, N] fp32 = x [M, K] bf16 . W^T for a group-affine weight in a dot layout (q8act.h), on AVX2
inline torch::Tensor affine_linear_avx2(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale,
                                        const torch::Tensor& minimum, int64_t group, int64_t offset, int64_t high_bits) {
  const uint8_t* cp = static_cast<const uint8_t*>(codes.data_ptr());
  return q8act::dot_linear(x, codes, scale, minimum, group, offset, high_bits, q8act::HIGH_BITS_SHIFTS, 0,
                           [&](const auto& sc, int bits, const q8act::Activations& acts, torch::Tensor& y) {
    using S = std::decay_t<decltype(sc)>;
    float* yp = y.data_ptr<float>();
    if (bits == 4) q8act256::column_blocks<4, S>(acts, cp, sc, codes.size(0), yp);
    else if (bits == 5) q8act256::column_blocks<5, S>(acts, cp, sc, codes.size(0), yp);
    else if (bits == 6) q8act256::column_blocks<6, S>(acts, cp, sc, codes.size(0), yp);
    else q8act256::column_blocks<8, S>(acts, cp, sc, codes.size(0), yp);
  });
}

}  // namespace draftwise
