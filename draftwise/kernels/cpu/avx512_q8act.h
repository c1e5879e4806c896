// The int8-activation group-affine linear (q8act.h: layouts, order of operations) on AVX512-VNNI:
// vpdpbusd multiplies 64 unsigned code bytes by 64 signed activation bytes and adds each lane's four
// products to its int32, so one instruction is 16 columns x 4 inputs. A 64-byte code step holds an
// octet of inputs for 16 columns: its low nibbles are inputs 0-3, its high nibbles 4-7 (5-bit codes
// add 16 where the step's high-bit masks say; int8 codes are two 64-byte quads, made unsigned by
// flipping the sign bit: code + 128, the 128 taken out with the offset; 6-bit codes add 16 and 32). Each step is loaded once and
// serves every row of the tile. A tile of fewer than ONE_CHAIN_ROWS rows gives each row two int32
// chains (inputs 0-3 and 4-7 of the octets, added at the group's end: exact), so one row's dot
// products do not wait on one long chain; taller tiles have chains enough in their rows, and one
// chain a row saves that add (a tenth of an 8-row tile's vector instructions).
#pragma once

#include "q8act.h"

#define AVX512VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))

namespace draftwise {
namespace q8act512 {

constexpr int MT_MAX = 8;      // rows per register tile (3 zmm each)
constexpr int ONE_CHAIN_ROWS = 5;   // tiles of at least this many rows: one int32 chain a row
// how far ahead the codes are prefetched: 8 KB. A tile of 8 rows spends ~8 cycles per 64-byte step,
// so common.h's 2 KB arrive only ~250 cycles ahead, short of DRAM's latency, and the tile waits on
// memory and arithmetic in turn; at 8 KB one linear at 4-8 rows ran 15-25 % faster and one row no
// slower (SmolLM2's shapes, 1 thread, Zen 5)
constexpr int CODE_PREFETCH_BYTES = 8192;

// 16 scales or minimums: fp32, or fp16 widened (exact)
AVX512VNNI inline __m512 scales16(const float* p) { return _mm512_loadu_ps(p); }
AVX512VNNI inline __m512 scales16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// one octet's codes as two unsigned byte vectors: a = inputs 0-3 of each column, b = inputs 4-7
template <int BITS>
AVX512VNNI inline void load_step(const uint8_t* p, __m512i& a, __m512i& b) {
  if constexpr (BITS == 8) {
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    a = _mm512_xor_si512(_mm512_loadu_si512(p), flip);
    b = _mm512_xor_si512(_mm512_loadu_si512(p + 64), flip);
  } else {
    const __m512i v = _mm512_loadu_si512(p), m = _mm512_set1_epi8(15);
    a = _mm512_and_si512(v, m);
    b = _mm512_and_si512(_mm512_srli_epi16(v, 4), m);
    // bits 4 (and 5) from the step's masks: 16 (32) added where set
    for (int t = 0; t < BITS - 4; ++t) {
      uint64_t lo, hi;
      std::memcpy(&lo, p + 64 + 16 * t, 8);
      std::memcpy(&hi, p + 72 + 16 * t, 8);
      const __m512i v16 = _mm512_set1_epi8(static_cast<char>(16 << t));
      a = _mm512_mask_add_epi8(a, lo, a, v16);
      b = _mm512_mask_add_epi8(b, hi, b, v16);
    }
  }
}

using TiledActivations = q8act::TiledActivations<MT_MAX>;

// A column block's per-group scales and minimums (fp32 or fp16), read per group by a run-time
// branch (the same for every group of a call, so always predicted) instead of a template parameter:
// a tile's code is then compiled once per bit width and row count rather than once per scale type
// as well. The super-block families have their own order (rows_super).
struct BlockScales {
  enum Kind { F32, F16 } kind;
  const void* s;
  const void* m;               // null where the family has no minimums
  static BlockScales of(const affine::F32Scales& sc) { return {F32, sc.s, sc.m}; }
  static BlockScales of(const affine::F16Scales& sc) { return {F16, sc.s, sc.m}; }
  AVX512VNNI __m512 lanes(const void* t, int g) const {
    if (kind == F16) return scales16(static_cast<const uint16_t*>(t) + g * NB);
    return scales16(static_cast<const float*>(t) + g * NB);
  }
};

// A register tile's shape: MT rows and OG = group / 8 octets a group as compile-time constants, so
// that a group's dot products are straight-line code and every row's chains stay in registers; or
// 0 for either, taken at run time (mt, og): the shapes no GGUF family produces compile to one body
// each instead of eight (a first start compiles this file).
template <int BITS, int OG, bool SUPER>
constexpr bool every_height_compiled() {
  if constexpr (!SUPER) return OG == 4 && BITS != 6;        // Q4_0 - Q8_0, IQ4_NL: 4-, 5-, 8-bit, groups of 32
  else return BITS == 4 || (BITS == 6 ? OG == 2 : OG == 4);  // Q2_K, Q3_K, Q4_K; Q6_K; Q5_K, IQ4_XS
}

// one group's dot products for the tile's rows into dots[r]: per row the exact int32 sum of the
// codes times the quantized activations less the offset term corr_g[r] (the first chain starts at
// minus it: exact integers, the same sum as subtracting it at the end)
template <int BITS, int MT, int OG>
AVX512VNNI __attribute__((always_inline)) inline void group_dots(const uint8_t* pg, const int32_t* xg,
                                                                 const int32_t* corr_g, int mt, int og,
                                                                 __m512i* dots) {
  constexpr int64_t sb = q8act::step_bytes(BITS);
  constexpr int CAP = MT ? MT : MT_MAX;
  const bool one = mt >= ONE_CHAIN_ROWS;
  __m512i ia[CAP], ib[CAP];
#pragma GCC unroll 8
  for (int r = 0; r < mt; ++r) {
    ia[r] = _mm512_set1_epi32(-corr_g[r]);
    ib[r] = _mm512_setzero_si512();
  }
#pragma GCC unroll 4
  for (int o = 0; o < og; ++o) {
    q8act::prefetch_step<BITS>(pg + o * sb, CODE_PREFETCH_BYTES);
    __m512i a, b;
    load_step<BITS>(pg + o * sb, a, b);
    const int32_t* xo = xg + o * mt * 2;
#pragma GCC unroll 8
    for (int r = 0; r < mt; ++r) {
      ia[r] = _mm512_dpbusd_epi32(ia[r], a, _mm512_set1_epi32(xo[2 * r]));
      if (one) ia[r] = _mm512_dpbusd_epi32(ia[r], b, _mm512_set1_epi32(xo[2 * r + 1]));
      else ib[r] = _mm512_dpbusd_epi32(ib[r], b, _mm512_set1_epi32(xo[2 * r + 1]));
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < mt; ++r) dots[r] = one ? ia[r] : _mm512_add_epi32(ia[r], ib[r]);
}

// the rows of register tile `t` (mt its height) of one column block (its codes `pk`, its per-group
// scales `sc`): per group, acc = fma(float(dot), scale * d, acc), then the minimum's term
template <int BITS, int MT, int OG>
AVX512VNNI void rows(const TiledActivations& ta, int t, const uint8_t* pk, const BlockScales& sc, float* y, int64_t N,
                     int mt_rt = MT, int og_rt = OG) {
  const int mt = MT ? MT : mt_rt, og = OG ? OG : og_rt;
  const int G = ta.G, group = og * q8act::OCTET;
  constexpr int64_t sb = q8act::step_bytes(BITS);
  constexpr int CAP = MT ? MT : MT_MAX;
  __m512 acc[CAP];
#pragma GCC unroll 8
  for (int r = 0; r < mt; ++r) acc[r] = _mm512_setzero_ps();
  const auto [xq, corr, xd, xs] = ta.tile(t);
  for (int g = 0; g < G; ++g) {
    __m512i dots[CAP];
    group_dots<BITS, MT, OG>(pk + static_cast<int64_t>(g) * og * sb, xq + static_cast<int64_t>(g) * og * mt * 2,
                             corr + g * mt, mt, og, dots);
    const __m512 s = sc.lanes(sc.s, g);
    const int db = g * group / q8act::QBLOCK;
#pragma GCC unroll 8
    for (int r = 0; r < mt; ++r) {
      const __m512 sd = _mm512_mul_ps(s, _mm512_set1_ps(xd[db * mt + r]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[r]), sd, acc[r]);
    }
    if (sc.m) {
      const __m512 m = sc.lanes(sc.m, g);
#pragma GCC unroll 8
      for (int r = 0; r < mt; ++r) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[g * mt + r]), acc[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < mt; ++r) _mm512_storeu_ps(y + static_cast<int64_t>(r) * N, acc[r]);
}

// The rows of register tile `t` of one column block with super-block factors (q8act.h: the
// super-block order). Per group the dot products, times the group's sub-scales into the
// super-block's int32 sums P (exact); per super-block one fma of float(P) by D * d, and for the
// families with minimums the minimums' integer sums T (exact in fp32: every partial sum under
// 2^24) by Dmin * d. 32 / og groups per super-block (group 16: 16, group 32: 8).
template <int BITS, int MT, int OG>
AVX512VNNI void rows_super(const TiledActivations& ta, int t, const uint8_t* pk, const q8act::SuperScales& sc, float* y,
                           int64_t N, int mt_rt = MT, int og_rt = OG) {
  const int mt = MT ? MT : mt_rt, og = OG ? OG : og_rt;
  const int G = ta.G, gps = q8act::QBLOCK_SUPER / (og * q8act::OCTET);
  constexpr int64_t sb = q8act::step_bytes(BITS);
  constexpr int CAP = MT ? MT : MT_MAX;
  __m512 acc[CAP];
#pragma GCC unroll 8
  for (int r = 0; r < mt; ++r) acc[r] = _mm512_setzero_ps();
  const auto [xq, corr, xd, xs] = ta.tile(t);
  for (int s = 0; s < G / gps; ++s) {
    const uint8_t* rs = sc.record(sc.s, s);
    __m512i P[CAP];
#pragma GCC unroll 8
    for (int r = 0; r < mt; ++r) P[r] = _mm512_setzero_si512();
    for (int gi = 0; gi < gps; ++gi) {
      const int g = s * gps + gi;
      __m512i dots[CAP];
      group_dots<BITS, MT, OG>(pk + static_cast<int64_t>(g) * og * sb, xq + static_cast<int64_t>(g) * og * mt * 2,
                               corr + g * mt, mt, og, dots);
      const __m512i s32 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rs + 32 + gi * NB)));
#pragma GCC unroll 8
      for (int r = 0; r < mt; ++r) P[r] = _mm512_add_epi32(P[r], _mm512_mullo_epi32(dots[r], s32));
    }
    const __m512 D = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rs)));
#pragma GCC unroll 8
    for (int r = 0; r < mt; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(P[r]), _mm512_mul_ps(D, _mm512_set1_ps(xd[s * mt + r])), acc[r]);
    if (sc.m) {
      const uint8_t* rm = sc.record(sc.m, s);
      __m512 T[CAP];
#pragma GCC unroll 8
      for (int r = 0; r < mt; ++r) T[r] = _mm512_setzero_ps();
      for (int gi = 0; gi < gps; ++gi) {
        const __m512 mv = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rm + 32 + gi * NB))));
        const float* xg = xs + static_cast<int64_t>(s * gps + gi) * mt;
#pragma GCC unroll 8
        for (int r = 0; r < mt; ++r) T[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xg[r]), T[r]);
      }
      const __m512 Dm = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rm)));
#pragma GCC unroll 8
      for (int r = 0; r < mt; ++r)
        acc[r] = _mm512_fmadd_ps(T[r], _mm512_mul_ps(Dm, _mm512_set1_ps(xd[s * mt + r])), acc[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < mt; ++r) _mm512_storeu_ps(y + static_cast<int64_t>(r) * N, acc[r]);
}

// a tile of mt rows (1-8) of a group size: the kernel compiled for its height where the shape is a
// GGUF family's, else the run-time shaped one
template <int BITS, int OG, typename S>
AVX512VNNI void rows_og(int mt, const TiledActivations& ta, int t, const uint8_t* pk, const S& sc, float* y,
                        int64_t N) {
  constexpr bool SUPER = std::is_same_v<S, q8act::SuperScales>;
  const auto run = [&](auto tag) {
    constexpr int H = decltype(tag)::value;
    if constexpr (SUPER) rows_super<BITS, H, H ? OG : 0>(ta, t, pk, sc, y, N, mt, OG);
    else rows<BITS, H, H ? OG : 0>(ta, t, pk, sc, y, N, mt, OG);
  };
  if constexpr (!every_height_compiled<BITS, OG, SUPER>()) {
    run(std::integral_constant<int, 0>{});
  } else {
    switch (mt) {
#define CASE(n) case n: run(std::integral_constant<int, n>{}); break;
      CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
      default: break;
    }
  }
}

template <int BITS, typename S>
AVX512VNNI void rows_any(int mt, int group, const TiledActivations& ta, int t, const uint8_t* pk, const S& scales,
                         float* y, int64_t N) {
  if constexpr (std::is_same_v<S, q8act::SuperScales>) {
    if (group == 16) rows_og<BITS, 2>(mt, ta, t, pk, scales, y, N);
    else rows_og<BITS, 4>(mt, ta, t, pk, scales, y, N);
  } else {
    const BlockScales sc = BlockScales::of(scales);
    if (group == 16) rows_og<BITS, 2>(mt, ta, t, pk, sc, y, N);
    else rows_og<BITS, 4>(mt, ta, t, pk, sc, y, N);
  }
}

// every column block, in parallel; within a thread's share, rows in chunks whose activations stay
// in cache, each chunk in register tiles of up to MT_MAX rows
template <int BITS, typename S>
void column_blocks(const q8act::Activations& act, const uint8_t* codes, const S& scales, int64_t blocks, float* y) {
  static_assert(q8act::ROW_CHUNK % MT_MAX == 0, "row chunks are whole register tiles");
  const int M = act.M;
  const int64_t N = blocks * NB, block_bytes = static_cast<int64_t>(act.K / q8act::OCTET) * q8act::step_bytes(BITS);
  // reused per calling thread (a step calls the linears hundreds of times); the workers below read
  // the caller's copy through this reference
  thread_local TiledActivations tiled;
  const TiledActivations& ta = tiled;
  tiled.fill(act);
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int c0 = 0; c0 < M; c0 += q8act::ROW_CHUNK) {
      const int c1 = std::min(M, c0 + q8act::ROW_CHUNK);
      for (int64_t b = b0; b < b1; ++b) {
        const S sc = scales.at(b);
        for (int r = c0; r < c1; r += MT_MAX)
          rows_any<BITS>(std::min(MT_MAX, c1 - r), act.group, ta, r / MT_MAX, codes + b * block_bytes, sc,
                         y + static_cast<int64_t>(r) * N + b * NB, N);
      }
    }
  });
}

}  // namespace q8act512

// y [M, N] fp32 = x [M, K] bf16 . W^T for a group-affine weight in a dot layout (q8act.h)
torch::Tensor affine_linear(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale,
                            const torch::Tensor& minimum, int64_t group, int64_t offset, int64_t high_bits) {
  const uint8_t* cp = static_cast<const uint8_t*>(codes.data_ptr());
  return q8act::dot_linear(x, codes, scale, minimum, group, offset, high_bits, q8act::HIGH_BITS_MASKS, 128,
                           [&](const auto& sc, int bits, const q8act::Activations& acts, torch::Tensor& y) {
    using S = std::decay_t<decltype(sc)>;
    float* yp = y.data_ptr<float>();
    if (bits == 4) q8act512::column_blocks<4, S>(acts, cp, sc, codes.size(0), yp);
    else if (bits == 5) q8act512::column_blocks<5, S>(acts, cp, sc, codes.size(0), yp);
    else if (bits == 6) q8act512::column_blocks<6, S>(acts, cp, sc, codes.size(0), yp);
    else q8act512::column_blocks<8, S>(acts, cp, sc, codes.size(0), yp);
  });
}

}  // namespace draftwise
