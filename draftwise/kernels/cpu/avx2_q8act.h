// The int8-activation group-affine linear (q8act.h: layouts, order of operations) on AVX2:
// vpmaddubsw multiplies 32 unsigned code bytes by 32 signed activation bytes and adds adjacent
// pairs to int16, vpmaddwd with ones adds those pairs to int32: per 256-bit vector 8 columns x 4
// inputs; with AVX-VNNI (Intel's client CPUs without AVX-512 have it) vpdpbusd does both at once.
// A column block is run as two halves of 8 columns (bytes 0-31 and 32-63 of each 64-byte step).
// Products stay inside int16: 4- to 6-bit codes (at most 63 x 127 x 2 per pair; an octet's two
// pairs summed: 32,004); int8 codes use the sign trick (|code| x activation with the code's sign:
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

#ifdef DRAFTWISE_AVX_VNNI
constexpr bool VNNI = true;    // built with -mavxvnni for a CPU that has it (kernels/__init__.py)
#else
constexpr bool VNNI = false;
#endif

// octets whose int16 pair sums (vpmaddubsw, then vpaddw) add up before they are widened to int32:
// an octet adds per 16-bit lane two pairs of products of at most (2^BITS - 1) x 127, so 4-bit codes
// take 4 octets (30,480), 5-bit 2 (31,496), 6-bit 1 (32,004)
template <int BITS>
constexpr int int16_span() { return BITS == 4 ? 4 : BITS == 5 ? 2 : 1; }

// 4- to 6-bit codes: one octet of one half-block (a = inputs 0-3 of its 8 columns, b = 4-7) times a
// row's two activation words, as int16 pair sums added to s
DW_AVX2 inline __m256i dot16(__m256i s, __m256i a, __m256i b, __m256i va, __m256i vb) {
  return _mm256_add_epi16(s, _mm256_add_epi16(_mm256_maddubs_epi16(a, va), _mm256_maddubs_epi16(b, vb)));
}

// the same into int32 sums: with AVX-VNNI one vpdpbusd per word (4 products a lane, exact); 8-bit
// codes by the sign trick (|code| as unsigned bytes, 128 included, times the activation given the
// code's sign), each vpmaddubsw widened alone (a pair up to 128 x 127 x 2 = 32,512)
template <int BITS>
DW_AVX2 inline __m256i dot32(__m256i acc, __m256i a, __m256i b, __m256i va, __m256i vb) {
  if constexpr (BITS == 8) {
    va = _mm256_sign_epi8(va, a);
    vb = _mm256_sign_epi8(vb, b);
    a = _mm256_abs_epi8(a);
    b = _mm256_abs_epi8(b);
  }
#ifdef DRAFTWISE_AVX_VNNI
  return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(acc, a, va), b, vb);
#else
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (BITS == 8)
    return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(a, va), ones),
                                                  _mm256_madd_epi16(_mm256_maddubs_epi16(b, vb), ones)));
  else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(dot16(_mm256_setzero_si256(), a, b, va, vb), ones));
#endif
}

using TiledActivations = q8act::TiledActivations<MT_MAX>;

// half h of the tile's rows in y (their fp32 accumulators): y += float(sums) * (scale * d[r])
template <int MT>
DW_AVX2 inline void add_scaled(float* y, int64_t N, int h, __m256 scale, const float* d, const __m256i (&sums)[MT][2]) {
#pragma GCC unroll 4
  for (int r = 0; r < MT; ++r) {
    float* yr = y + r * N + h * 8;
    const __m256 sd = _mm256_mul_ps(scale, _mm256_set1_ps(d[r]));
    _mm256_storeu_ps(yr, _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r][h]), sd, _mm256_loadu_ps(yr)));
  }
}

// octets [o0, o1) of the tile's MT rows, both halves: each code step loaded and unpacked once, each
// activation word broadcast once, and per row and half `f(r, h, a, b, va, vb)`
template <int BITS, int MT, typename F>
DW_AVX2 inline void octets(const uint8_t* pk, const int32_t* xq, int o0, int o1, const F& f) {
  constexpr int64_t sb = q8act::step_bytes(BITS);
  for (int o = o0; o < o1; ++o) {
    q8act::prefetch_step<BITS>(pk + o * sb, PREFETCH_BYTES);
    __m256i a[2], b[2];
    load_half<BITS>(pk + o * sb, 0, a[0], b[0]);
    load_half<BITS>(pk + o * sb, 1, a[1], b[1]);
    const int32_t* xo = xq + static_cast<int64_t>(o) * MT * 2;
#pragma GCC unroll 4
    for (int r = 0; r < MT; ++r) {
      const __m256i va = _mm256_set1_epi32(xo[2 * r]), vb = _mm256_set1_epi32(xo[2 * r + 1]);
      f(r, 0, a[0], b[0], va, vb);
      f(r, 1, a[1], b[1], va, vb);
    }
  }
}

// The MT rows of register tile `t` (MT its height) of one column block (its codes `pk`, its scales
// `sc`), both halves of 8 columns at once. Per group, each row's integer sums are the codes' dot
// products less the group's offset term; without VNNI, 4- to 6-bit codes gather int16 sums over
// int16_span octets and widen them once (one vpmaddwd where each octet took one). The rows' fp32
// accumulators live in y itself (L1), leaving the 16 vector registers to the integer sums, the codes
// and the broadcast activations. Integer sums are exact, so every path and tile height gives a row
// the same bits.
template <int BITS, int MT, typename S>
DW_AVX2 void rows(const TiledActivations& ta, int t, int OG, const uint8_t* pk, const S& sc, float* y, int64_t N) {
  const int G = ta.G, group = OG * q8act::OCTET;
  constexpr int64_t sb = q8act::step_bytes(BITS);
  constexpr int SPAN = (VNNI || BITS == 8) ? 1 : int16_span<BITS>();
  const __m256i ones = _mm256_set1_epi16(1);
  const auto [xq, corr, xd, xs] = ta.tile(t);
  for (int r = 0; r < MT; ++r)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(y + r * N + h * 8, _mm256_setzero_ps());
  for (int g = 0; g < G; ++g) {
    const uint8_t* pg = pk + static_cast<int64_t>(g) * OG * sb;
    const int32_t* xg = xq + static_cast<int64_t>(g) * OG * MT * 2;
    __m256i ia[MT][2];
    if constexpr (SPAN == 1) {
#pragma GCC unroll 4
      for (int r = 0; r < MT; ++r) ia[r][0] = ia[r][1] = _mm256_set1_epi32(-corr[g * MT + r]);
      octets<BITS, MT>(pg, xg, 0, OG, [&](int r, int h, __m256i a, __m256i b, __m256i va, __m256i vb) {
        ia[r][h] = dot32<BITS>(ia[r][h], a, b, va, vb);
      });
    } else {
      // the first span apart, so that no int32 sum is live while its int16 sums are gathered
      __m256i s16[MT][2];
      const auto gather = [&](int o0) {
#pragma GCC unroll 4
        for (int r = 0; r < MT; ++r) s16[r][0] = s16[r][1] = _mm256_setzero_si256();
        octets<BITS, MT>(pg, xg, o0, std::min(OG, o0 + SPAN), [&](int r, int h, __m256i a, __m256i b, __m256i va,
                                                                   __m256i vb) {
          s16[r][h] = dot16(s16[r][h], a, b, va, vb);
        });
      };
      gather(0);
#pragma GCC unroll 4
      for (int r = 0; r < MT; ++r)
        for (int h = 0; h < 2; ++h)
          ia[r][h] = _mm256_sub_epi32(_mm256_madd_epi16(s16[r][h], ones), _mm256_set1_epi32(corr[g * MT + r]));
      for (int o0 = SPAN; o0 < OG; o0 += SPAN) {
        gather(o0);
#pragma GCC unroll 4
        for (int r = 0; r < MT; ++r)
          for (int h = 0; h < 2; ++h) ia[r][h] = _mm256_add_epi32(ia[r][h], _mm256_madd_epi16(s16[r][h], ones));
      }
    }
    const int db = g * group / q8act::QBLOCK;
    for (int h = 0; h < 2; ++h) add_scaled<MT>(y, N, h, sc.scale(g, h), xd + db * MT, ia);
    if (sc.has_min()) {
      for (int h = 0; h < 2; ++h) {
        const __m256 m = sc.min(g, h);
#pragma GCC unroll 4
        for (int r = 0; r < MT; ++r) {
          float* yr = y + r * N + h * 8;
          _mm256_storeu_ps(yr, _mm256_fmadd_ps(m, _mm256_set1_ps(xs[g * MT + r]), _mm256_loadu_ps(yr)));
        }
      }
    }
  }
}

// The MT rows of register tile `t` of one column block with super-block factors (q8act.h: the
// super-block order), both halves at once. The group's sub-scales enter where its integer sums are
// widened: without VNNI the vpmaddwd that adds the int16 pair sums to int32 multiplies them by the
// sub-scales instead of by ones (llama.cpp's K-quant dot products on AVX2: no instruction added),
// the offset term taken out as sub-scale x offset x the group's input sum; with VNNI (and for 8-bit
// codes) the group's int32 sums times the sub-scales. Per super-block, one fma of float(P) by D * d
// into y, and for the families with minimums one of the minimums' sums T by Dmin * d.
template <int BITS, int MT>
DW_AVX2 void rows_super(const TiledActivations& ta, int t, int OG, const uint8_t* pk, const q8act::SuperScales& sc,
                        bool has_offset, float* y, int64_t N) {
  const int G = ta.G, GPS = q8act::QBLOCK_SUPER / (OG * q8act::OCTET);
  constexpr int64_t sb = q8act::step_bytes(BITS);
  constexpr int SPAN = (VNNI || BITS == 8) ? 1 : int16_span<BITS>();
  const auto [xq, corr, xd, xs] = ta.tile(t);
  for (int r = 0; r < MT; ++r)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(y + r * N + h * 8, _mm256_setzero_ps());
  for (int s = 0; s < G / GPS; ++s) {
    const uint8_t* rs = sc.record(sc.s, s);
    __m256i P[MT][2];
    for (int r = 0; r < MT; ++r) P[r][0] = P[r][1] = _mm256_setzero_si256();
    for (int gi = 0; gi < GPS; ++gi) {
      const int g = s * GPS + gi;
      const uint8_t* pg = pk + static_cast<int64_t>(g) * OG * sb;
      const int32_t* xg = xq + static_cast<int64_t>(g) * OG * MT * 2;
      const __m256i s32[2] = {q8act::SuperScales::sub8(rs, gi, 0), q8act::SuperScales::sub8(rs, gi, 1)};
      if constexpr (SPAN == 1) {
        __m256i ia[MT][2];
#pragma GCC unroll 4
        for (int r = 0; r < MT; ++r) ia[r][0] = ia[r][1] = _mm256_set1_epi32(-corr[g * MT + r]);
        octets<BITS, MT>(pg, xg, 0, OG, [&](int r, int h, __m256i a, __m256i b, __m256i va, __m256i vb) {
          ia[r][h] = dot32<BITS>(ia[r][h], a, b, va, vb);
        });
#pragma GCC unroll 4
        for (int r = 0; r < MT; ++r)
          for (int h = 0; h < 2; ++h) P[r][h] = _mm256_add_epi32(P[r][h], _mm256_mullo_epi32(ia[r][h], s32[h]));
      } else {
        // each column's sub-scale in both int16 halves of its lane: vpmaddwd's multipliers
        const __m256i lo16 = _mm256_set1_epi32(0xffff);
        const __m256i s16x2[2] = {_mm256_or_si256(_mm256_and_si256(s32[0], lo16), _mm256_slli_epi32(s32[0], 16)),
                                  _mm256_or_si256(_mm256_and_si256(s32[1], lo16), _mm256_slli_epi32(s32[1], 16))};
        for (int o0 = 0; o0 < OG; o0 += SPAN) {
          __m256i s16[MT][2];
#pragma GCC unroll 4
          for (int r = 0; r < MT; ++r) s16[r][0] = s16[r][1] = _mm256_setzero_si256();
          octets<BITS, MT>(pg, xg, o0, std::min(OG, o0 + SPAN), [&](int r, int h, __m256i a, __m256i b, __m256i va,
                                                                     __m256i vb) {
            s16[r][h] = dot16(s16[r][h], a, b, va, vb);
          });
#pragma GCC unroll 4
          for (int r = 0; r < MT; ++r)
            for (int h = 0; h < 2; ++h) P[r][h] = _mm256_add_epi32(P[r][h], _mm256_madd_epi16(s16[r][h], s16x2[h]));
        }
        if (has_offset) {
#pragma GCC unroll 4
          for (int r = 0; r < MT; ++r) {
            const __m256i c = _mm256_set1_epi32(corr[g * MT + r]);
            for (int h = 0; h < 2; ++h) P[r][h] = _mm256_sub_epi32(P[r][h], _mm256_mullo_epi32(c, s32[h]));
          }
        }
      }
    }
    for (int h = 0; h < 2; ++h) add_scaled<MT>(y, N, h, q8act::SuperScales::super8(rs, h), xd + s * MT, P);
    if (sc.has_min()) {
      const uint8_t* rm = sc.record(sc.m, s);
      for (int h = 0; h < 2; ++h) {
        __m256 T[MT];
        for (int r = 0; r < MT; ++r) T[r] = _mm256_setzero_ps();
        for (int gi = 0; gi < GPS; ++gi) {
          const __m256 mv = _mm256_cvtepi32_ps(q8act::SuperScales::sub8(rm, gi, h));
          const float* xg = xs + static_cast<int64_t>(s * GPS + gi) * MT;
#pragma GCC unroll 4
          for (int r = 0; r < MT; ++r) T[r] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xg[r]), T[r]);
        }
        const __m256 Dm = q8act::SuperScales::super8(rm, h);
#pragma GCC unroll 4
        for (int r = 0; r < MT; ++r) {
          float* yr = y + r * N + h * 8;
          const __m256 dd = _mm256_mul_ps(Dm, _mm256_set1_ps(xd[s * MT + r]));
          _mm256_storeu_ps(yr, _mm256_fmadd_ps(T[r], dd, _mm256_loadu_ps(yr)));
        }
      }
    }
  }
}

template <int BITS, typename S>
DW_AVX2 void rows_any(int mt, const TiledActivations& ta, int t, int OG, const uint8_t* pk, const S& sc,
                      bool has_offset, float* y, int64_t N) {
  if constexpr (std::is_same_v<S, q8act::SuperScales>) {
    switch (mt) {
      case 1: rows_super<BITS, 1>(ta, t, OG, pk, sc, has_offset, y, N); break;
      case 2: rows_super<BITS, 2>(ta, t, OG, pk, sc, has_offset, y, N); break;
      case 3: rows_super<BITS, 3>(ta, t, OG, pk, sc, has_offset, y, N); break;
      case 4: rows_super<BITS, 4>(ta, t, OG, pk, sc, has_offset, y, N); break;
      default: break;
    }
  } else {
    switch (mt) {
      case 1: rows<BITS, 1, S>(ta, t, OG, pk, sc, y, N); break;
      case 2: rows<BITS, 2, S>(ta, t, OG, pk, sc, y, N); break;
      case 3: rows<BITS, 3, S>(ta, t, OG, pk, sc, y, N); break;
      case 4: rows<BITS, 4, S>(ta, t, OG, pk, sc, y, N); break;
      default: break;
    }
  }
}

// every column block, in parallel; within a thread's share, rows in chunks whose activations stay
// in cache, each chunk in register tiles of up to MT_MAX rows
template <int BITS, typename S>
void column_blocks(const q8act::Activations& act, const uint8_t* codes, const S& scales, int64_t blocks, float* y) {
  static_assert(q8act::ROW_CHUNK % MT_MAX == 0, "row chunks are whole register tiles");
  const int M = act.M, OG = act.group / q8act::OCTET;
  const int64_t N = blocks * NB, block_bytes = static_cast<int64_t>(act.K / q8act::OCTET) * q8act::step_bytes(BITS);
  thread_local TiledActivations tiled;   // reused per calling thread; the workers read the caller's copy
  const TiledActivations& ta = tiled;
  tiled.fill(act);
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int c0 = 0; c0 < M; c0 += q8act::ROW_CHUNK) {
      const int c1 = std::min(M, c0 + q8act::ROW_CHUNK);
      for (int64_t b = b0; b < b1; ++b) {
        const S sc = scales.at(b);
        for (int r = c0; r < c1; r += MT_MAX)
          rows_any<BITS, S>(std::min(MT_MAX, c1 - r), ta, r / MT_MAX, OG, codes + b * block_bytes, sc,
                            act.offset != 0, y + static_cast<int64_t>(r) * N + b * NB, N);
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
