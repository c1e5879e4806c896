// The group-affine linear (every GGUF block family, draftwise/formats) on int8 activations, as
// llama.cpp's CPU kernels run its block types: y[M, N] = x[M, K] . W[N, K]^T, fp32 out, with
//     W[n, k] = scale[n, g] * (code[n, k] - offset) + minimum[n, g]      g = k / group (16 or 32)
// held exactly (the file's own codes and scales). Two orders of operations, by how the file keeps
// its scales; in each, every row's arithmetic is the same whatever the number of rows in the call,
// so a row's bits never depend on the rows beside it:
//
// Per-group scales (the legacy families: fp32 / fp16 scale and minimum per group). Each row of x is
// quantized per block of 32 inputs to int8 with one fp32 scale (llama.cpp's q8_0: d = max|x| / 127,
// q = round-to-nearest-even(x / d)); per group, the exact integer dot product of (code - offset) and
// q, then
//     acc = fma(float(dot), scale * d, acc)
//     acc = fma(minimum, d * sum_k q, acc)              (the minimum times the group's quantized inputs)
//
// Super-block factors (K-quants, IQ4_XS: scale = D * sc, minimum = Dmin * m, D and Dmin fp16 per 256
// inputs, sc and m small integers per group). Each row is quantized per 256 inputs (llama.cpp's
// q8_K), so a super-block's groups share one activation scale d and the sub-scales apply in
// integers, as llama.cpp's K-quant dot products do:
//     P = sum_g sc_g * dot_g        (int32, exact)       T = sum_g m_g * sum_{k in g} q_k (exact)
//     acc = fma(float(P), D * d, acc)
//     acc = fma(float(T), Dmin * d, acc)               (families with minimums)
// one float step a super-block where the per-group order takes two or three a group: the rate of a
// few rows at a time is the integer products' own. The ISA files hold the dot products:
// avx512_q8act.h (VNNI vpdpbusd, 16 columns per instruction) and avx2_q8act.h (vpmaddubsw, 8
// columns; the sub-scales enter through the vpmaddwd that widens its sums).
//
// Code layouts ("dot layouts", made by draftwise/kernels/__init__.py:pack_affine), per block of 16
// output columns n0..n0+15 and octet o of inputs 8o..8o+7:
//   4-bit: uint8 [N/16, K/8, 64]: byte 4j + i = code[n0+j][8o+i] | code[n0+j][8o+4+i] << 4, so the
//          low nibbles are, per 32-bit lane j, column j's inputs 8o..8o+3 (the lane a dot-product
//          instruction sums) and the high nibbles its inputs 8o+4..8o+7
//   5-bit: uint8 [N/16, K/8, 80]: the 4-bit octet, then the codes' bit 4 in 16 bytes
//   6-bit: uint8 [N/16, K/8, 96]: the 4-bit octet, then bits 4 and 5 in 32 bytes (GGUF Q6_K)
//          The high bits come in one of two arrangements (HighBits; kernels/__init__.py:
//          _high_bit_places), each ISA's kernel reading its own: masks (AVX-512: per bit two
//          little-endian 64-bit masks, bit 4j + i of the first: code[n0+j][8o+i], of the second:
//          8o+4+i, which mask registers take as they are) or shifts (AVX2: per half-block of 8
//          columns, the byte u = 4j' + i of its 32 a-codes (inputs 0-3) and b-codes (4-7) has its
//          high bits where one fixed or variable shift and an and put them in place: 6-bit as
//          2-bit crumbs, byte u crumb 2h + s; 5-bit as byte u % 16, bit 2 (2h + s) + u / 16)
//   8-bit: int8  [N/16, K/8, 128]: two 64-byte quads, byte 4j + i of quad h = code[n0+j][8o+4h+i]
//          less the offset (stored signed; the kernel is called with offset 0)
// scale / minimum: [N/16, K/group, 16] fp32 or fp16 (affine.h's GroupScales), or for the super-block
// families the file's factors (SuperScales): uint8 [N/16, K/256, 32 + 16 gps] (gps = 256 / group),
// per super-block 16 fp16 super-scales then gps x 16 int8 sub-scales; scale = d * sc, exact in fp32.
#pragma once

#include "affine.h"

namespace draftwise {
namespace q8act {

constexpr int QBLOCK = 32;     // inputs per activation scale, per-group scales
constexpr int QBLOCK_SUPER = 256;   // inputs per activation scale, super-block factors
constexpr int OCTET = 8;       // inputs per code step
constexpr int ROW_CHUNK = 64;  // rows whose activations stay in cache while a thread's column blocks pass

enum HighBits { HIGH_BITS_MASKS = 0, HIGH_BITS_SHIFTS = 1 };   // kernels/__init__.py: HIGH_BITS
inline const char* high_bits_name(int64_t h) { return h == HIGH_BITS_SHIFTS ? "shifts" : "masks"; }

constexpr int64_t step_bytes(int bits) { return bits == 8 ? 128 : 64 + 16 * (bits - 4); }

// every cache line of the code step at p + ahead: its first, 64 bytes on and its last byte (a step
// of 80, 96 or 128 bytes spans two or three lines, not aligned to them for 5- and 6-bit codes; one
// prefetch per step left a third to a half of those lines to the hardware prefetcher)
template <int BITS>
inline void prefetch_step(const uint8_t* p, int64_t ahead) {
  constexpr int64_t sb = step_bytes(BITS);
  const uint8_t* a = p + ahead;
  prefetch_weights(a);
  if constexpr (sb > 64) {
    prefetch_weights(a + 64);
    prefetch_weights(a + sb - 1);
  }
}

// The scales of the super-block families as their files store them (a column block's 16 lanes
// per super-block: D fp16 [16], then sc int8 [gps][16]; the minimums' record alike: Dmin negated,
// then m), read by the ISA kernels' super-block order (above).
struct SuperScales {
  const uint8_t* s;
  const uint8_t* m;             // the minimums' factors (dmin negated, m), or null
  int G, gps;
  static int64_t record_bytes(int gps) { return 32 + 16 * static_cast<int64_t>(gps); }
  int64_t rec() const { return record_bytes(gps); }
  SuperScales at(int64_t b) const {
    const int64_t off = b * (G / gps) * rec();
    return {s + off, m ? m + off : nullptr, G, gps};
  }
  bool has_min() const { return m != nullptr; }
  // super-block sb's record in table t (s or m)
  const uint8_t* record(const uint8_t* t, int sb) const { return t + sb * rec(); }
  // half h (8 columns) of a record's fp16 super-scales, widened (exact)
  DW_AVX2 static __m256 super8(const uint8_t* r, int h) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r + h * 16)));
  }
  // half h of group gi's (of the super-block) small integers, sign-extended to int32
  DW_AVX2 static __m256i sub8(const uint8_t* r, int gi, int h) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(r + 32 + gi * NB + h * 8)));
  }
};

// x's rows quantized for the dot products, and what the group terms need
struct Activations {
  int M, K, group, G, qblock;  // qblock: inputs per scale, QBLOCK or QBLOCK_SUPER
  int offset = 0;              // taken out of the codes (plus the 8-bit codes' shift to unsigned)
  Aligned<int8_t> q;           // [M, K] int8 codes
  std::vector<float> d;        // [M, K / qblock] scale per block of qblock inputs
  std::vector<int32_t> corr;   // [M, G] offset * sum of the group's q (the codes' offset taken out exactly)
  std::vector<float> xs;       // [M, G] per-group scales: d * sum of the group's q (the minimum's term:
                               // as llama.cpp's q8_1 sums, so a weight's whole value meets the same
                               // quantized input; the exact input sum beside quantized code products
                               // has ~3x the error); super-block factors: sum of the group's q (exact)
  Activations(int M_, int K_, int group_, int qblock_)
      : M(M_), K(K_), group(group_), G(K_ / group_), qblock(qblock_), q(static_cast<size_t>(M_) * K_),
        d(static_cast<size_t>(M_) * (K_ / qblock_)), corr(static_cast<size_t>(M_) * G),
        xs(static_cast<size_t>(M_) * G) {}
  const int8_t* row(int r) const { return q.p + static_cast<int64_t>(r) * K; }
  bool super() const { return qblock == QBLOCK_SUPER; }
};

// 8 fp32 -> 8 int32, round to nearest even (the default MXCSR mode), then the 32 of a block packed
// to int8 in input order
DW_AVX2 inline void store_q32(__m256 v[4], __m256 id, int8_t* out) {
  __m256i i[4];
  for (int t = 0; t < 4; ++t) i[t] = _mm256_cvtps_epi32(_mm256_mul_ps(v[t], id));
  // packs work per 128-bit lane: [0-3, 8-11, 4-7, 12-15] then bytes [0-3, 8-11, 16-19, 24-27 | 4-7, ...]
  const __m256i p16a = _mm256_packs_epi32(i[0], i[1]), p16b = _mm256_packs_epi32(i[2], i[3]);
  const __m256i p8 = _mm256_packs_epi16(p16a, p16b);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                      _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

// 32 bf16 inputs widened to fp32
DW_AVX2 inline void load32(const uint16_t* x, __m256 v[4]) {
  for (int t = 0; t < 4; ++t)
    v[t] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + t * 8))), 16));
}

// one row: bf16 [K] -> int8 q [K], d [K / qblock], group sums of q (times offset) and the group term
DW_AVX2 inline void quantize_row(const uint16_t* x, int K, int group, int offset, int qblock, int8_t* q, float* d,
                                 int32_t* corr, float* xs) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int b = 0; b < K / qblock; ++b) {
    const uint16_t* xb = x + static_cast<int64_t>(b) * qblock;
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int c = 0; c < qblock; c += QBLOCK) {
      load32(xb + c, v);
      for (int t = 0; t < 4; ++t) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[t]));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    const float dd = _mm_cvtss_f32(m) / 127.0f;
    d[b] = dd;
    const __m256 id = _mm256_set1_ps(dd > 0.0f ? 1.0f / dd : 0.0f);
    for (int c = 0; c < qblock; c += QBLOCK) {
      load32(xb + c, v);
      store_q32(v, id, q + static_cast<int64_t>(b) * qblock + c);
    }
  }
  for (int g = 0; g < K / group; ++g) {
    int32_t s = 0;
    for (int k = 0; k < group; ++k) s += q[g * group + k];
    corr[g] = offset * s;
    xs[g] = qblock == QBLOCK ? d[g * group / QBLOCK] * static_cast<float>(s) : static_cast<float>(s);
  }
}

// every row of x (bf16 [M, K]) quantized, in parallel
inline void quantize_rows(const torch::Tensor& x, int group, int offset, Activations& a) {
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const int K = a.K, G = a.G;
  for_rows(a.M, [&](int64_t r) {
    quantize_row(xp + r * K, K, group, offset, a.qblock, a.q.p + r * K, a.d.data() + r * (K / a.qblock),
                 a.corr.data() + r * G, a.xs.data() + r * G);
  });
}

// The activations of each register tile of TILE rows interleaved row by row (as llama.cpp's
// q8_0x4 / q8_Kx8 repacked activations): an octet's two int32 words of the tile's rows side by
// side, and likewise each group's offset term and input sum and each block's scale. One pointer per
// array then serves every row of the tile with constant displacements; eight row pointers per
// array would not fit the general registers, and their reloads cost the 8-row tile ~40 % of its
// throughput. Within a tile the rows are interleaved at the tile's own height (TILE, or fewer in
// the last tile), so a single row's activations are as compact as x itself: padded to TILE, one
// row of the down projection (K = 8,960) spread over 72 KB, past L1, for every column block.
template <int TILE>
struct TiledActivations {
  static constexpr int64_t FILL_GRAIN = 64;     // rows per thread's share of the copy, at least
  int tiles = 0, octets = 0, G = 0, blocks = 0;
  std::vector<int32_t> q;      // [tiles][octets][mt][2]   (mt: the tile's rows; tiles TILE apart)
  std::vector<int32_t> corr;   // [tiles][G][mt]
  std::vector<float> d;        // [tiles][blocks][mt]
  std::vector<float> xs;       // [tiles][G][mt]

  // register tile t's arrays: its rows' code words, offset terms, scales and group terms
  struct Tile { const int32_t* q; const int32_t* corr; const float* d; const float* xs; };
  Tile tile(int t) const {
    return {q.data() + static_cast<int64_t>(t) * octets * TILE * 2, corr.data() + static_cast<int64_t>(t) * G * TILE,
            d.data() + static_cast<int64_t>(t) * blocks * TILE, xs.data() + static_cast<int64_t>(t) * G * TILE};
  }

  void fill(const q8act::Activations& act) {
    tiles = (act.M + TILE - 1) / TILE;
    octets = act.K / q8act::OCTET;
    G = act.G;
    blocks = act.K / act.qblock;
    // every element is written below (a tile holds exactly its rows)
    const size_t M = static_cast<size_t>(act.M);
    q.resize(M * octets * 2);
    corr.resize(M * G);
    d.resize(M * blocks);
    xs.resize(M * G);
    // rows in parallel where there are many (a prefill chunk: serial, this copy held the other
    // threads waiting ~2 % of a prompt's time); each row writes its own elements
    at::parallel_for(0, act.M, FILL_GRAIN, [&](int64_t r0, int64_t r1) {
      for (int r = static_cast<int>(r0); r < r1; ++r) fill_row(act, r);
    });
  }

  void fill_row(const q8act::Activations& act, int r) {
    const int t = r / TILE, rr = r % TILE, mt = std::min(TILE, act.M - t * TILE);
    const int32_t* w = reinterpret_cast<const int32_t*>(act.row(r));
    int32_t* tq = q.data() + static_cast<int64_t>(t) * octets * TILE * 2 + rr * 2;
    for (int o = 0; o < octets; ++o) {
      tq[o * mt * 2] = w[2 * o];
      tq[o * mt * 2 + 1] = w[2 * o + 1];
    }
    const int64_t tg = static_cast<int64_t>(t) * G * TILE, tb = static_cast<int64_t>(t) * blocks * TILE;
    for (int g = 0; g < G; ++g) {
      corr[tg + g * mt + rr] = act.corr[static_cast<int64_t>(r) * G + g];
      xs[tg + g * mt + rr] = act.xs[static_cast<int64_t>(r) * G + g];
    }
    for (int b = 0; b < blocks; ++b) d[tb + b * mt + rr] = act.d[static_cast<int64_t>(r) * blocks + b];
  }
};

// the arguments' checks and the layout's bit width (4, 5 or 8), shared by every ISA
inline int check_dot_layout(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale,
                            const torch::Tensor& minimum, int64_t group) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.is_contiguous(), "x: contiguous bf16 [M, K]");
  TORCH_CHECK(group == 16 || group == 32, "group: 16 or 32");
  const int64_t K = x.size(1);
  TORCH_CHECK(K % QBLOCK == 0, "K: a multiple of 32");
  TORCH_CHECK(codes.dim() == 3 && codes.is_contiguous() && codes.size(1) * OCTET == K, "codes: contiguous [N/16, K/8, .]");
  int bits = 0;
  for (int b : {4, 5, 6})
    if (codes.scalar_type() == torch::kByte && codes.size(2) == step_bytes(b)) bits = b;
  if (codes.scalar_type() == torch::kChar && codes.size(2) == step_bytes(8)) bits = 8;
  TORCH_CHECK(bits, "codes: uint8 [N/16, K/8, 64 | 80 | 96] (4-, 5-, 6-bit) or int8 [.., 128] (8-bit)");
  const int64_t N = codes.size(0) * NB;
  if (scale.scalar_type() == torch::kByte) {
    TORCH_CHECK(K % 256 == 0 && scale.is_contiguous() && scale.numel() == N / NB * (K / 256) * (32 + 16 * (256 / group)),
                "scale: super-block factors uint8 [N/16, K/256, 32 + 16 * 256/group]");
  } else {
    TORCH_CHECK((scale.scalar_type() == torch::kFloat || scale.scalar_type() == torch::kHalf) && scale.is_contiguous() &&
                scale.numel() == N * (K / group), "scale: contiguous fp32 or fp16 [N/16, K/group, 16]");
  }
  TORCH_CHECK(minimum.numel() == 0 || (minimum.scalar_type() == scale.scalar_type() && minimum.is_contiguous() &&
                                       minimum.numel() == scale.numel()), "minimum: like scale, or empty");
  return bits;
}

// y = x . W^T: x quantized, then `blocks_fn(scales, bits, acts, y)` over the column blocks (an ISA's
// kernel, reading 5- and 6-bit codes in the arrangement `reads`) with the scale table in its type
template <typename F>
torch::Tensor dot_linear(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale,
                         const torch::Tensor& minimum, int64_t group, int64_t offset, int64_t high_bits,
                         HighBits reads, int extra_offset, const F& blocks_fn) {
  const int bits = check_dot_layout(x, codes, scale, minimum, group);
  TORCH_CHECK(bits == 4 || bits == 8 || high_bits == reads, "codes: ", bits, "-bit codes packed with their high bits as ",
              high_bits_name(high_bits), ", but these kernels read ", high_bits_name(reads),
              " (pack the weight under the ISA that runs it)");
  const int M = x.size(0), K = x.size(1), G = K / static_cast<int>(group);
  auto y = new_empty({M, codes.size(0) * NB}, x.options().dtype(torch::kFloat));
  if (M == 0) return y;
  const bool super = scale.scalar_type() == torch::kByte;
  Activations acts(M, K, static_cast<int>(group), super ? QBLOCK_SUPER : QBLOCK);
  // the 8-bit codes enter the unsigned dot products shifted by `extra_offset` (128 on VNNI)
  acts.offset = static_cast<int>(offset) + (bits == 8 ? extra_offset : 0);
  quantize_rows(x, static_cast<int>(group), acts.offset, acts);
  const bool has_min = minimum.numel() > 0;
  if (super)
    blocks_fn(SuperScales{scale.data_ptr<uint8_t>(), has_min ? minimum.data_ptr<uint8_t>() : nullptr, G,
                          256 / static_cast<int>(group)}, bits, acts, y);
  else if (scale.scalar_type() == torch::kHalf)
    blocks_fn(affine::F16Scales{half_ptr(scale), has_min ? half_ptr(minimum) : nullptr, G}, bits, acts, y);
  else
    blocks_fn(affine::F32Scales{scale.data_ptr<float>(), has_min ? minimum.data_ptr<float>() : nullptr, G}, bits, acts,
              y);
  return y;
}

}  // namespace q8act
}  // namespace draftwise
