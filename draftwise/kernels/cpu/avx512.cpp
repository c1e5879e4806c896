// Weight-stationary int4 (group 32, Q4_1: w = q * scale + minimum) linear for small row counts on
// x86 CPUs with bf16 dot products: y[M, N] = x[M, K] (bf16) . W[N, K]^T, fp32 out.
//
// ATen's int4 kernel streams the packed weight once per 4 rows, dequantizing it again each time, so
// verifying 16 drafts costs ~5x decoding one token. Here every block of 16 output columns is
// dequantized once per call into a bf16 tile in the "pair" layout the dot-product instructions read
// (for k-pair p: 16 columns x (w[., 2p], w[., 2p+1])), and that tile then serves every row:
//   - AVX512-BF16: _mm512_dpbf16_ps, one broadcast x pair per row and k-pair;
//   - AMX-BF16 (where the OS grants the tile state): one 16x32 . 32x16 tile product per row tile
//     and group of 32 inputs.
// Each output row's arithmetic is the same whatever the number of rows in the call (rows are tiled
// independently and accumulate in the same order), so a token's logits do not depend on how many
// drafts were verified beside it: speculation stays bit-exact with plain decoding. The AMX and the
// AVX512-BF16 paths differ in rounding; one engine uses one of them for every row count.
//
// Layouts: common.h. The kernel forms minimum - 128 * scale in fp32 (see unpack_pairs).
// ATen and the Python bindings only (not torch/extension.h, which pulls in all of libtorch's C++ API
// and makes the first-run build ~40 % slower)
#include "avx512_affine.h"
#include "avx512_q8act.h"
#include <sys/syscall.h>
#include <unistd.h>
#include <memory>

namespace draftwise {
namespace {

#define AMXBF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")))

// nibbles of one column block -> bf16 of (128 + code), K/2 pairs x 16 columns x 2 (64-byte rows).
// 0x4300 | q is the bf16 bit pattern of 128 + q (exponent 7, unit steps), so unpacking is two bitwise
// ops per word; the 128 * sum(x) this adds is taken back through the minimum (minimum - 128 * scale).
AVX512BF16 inline void unpack_pairs(const uint8_t* pk, int p_begin, int p_end, uint16_t* out) {
  const __m512i lo_mask = _mm512_set1_epi32(0x0000000F), hi_mask = _mm512_set1_epi32(0x000F0000);
  const __m512i bias = _mm512_set1_epi32(0x43004300);
  for (int p = p_begin; p < p_end; ++p) {
    // decode streams every weight from DRAM: ask for the codes PREFETCH_BYTES ahead (the next
    // block's when near the end of this one: blocks are consecutive)
    prefetch_weights(pk + p * NB + PREFETCH_BYTES);
    // dword j = byte j = q[j][2p] | q[j][2p+1] << 4  ->  words (0x4300 | q[j][2p], 0x4300 | q[j][2p+1])
    const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pk + p * NB)));
    const __m512i lo = _mm512_ternarylogic_epi32(d, lo_mask, bias, 0xEA);                  // (d & m) | bias
    const __m512i w = _mm512_ternarylogic_epi32(_mm512_slli_epi32(d, 12), hi_mask, lo, 0xEA);
    _mm512_store_si512(out + p * 32, w);
  }
}

AVX512BF16 void unpack_codes(const uint8_t* pk, int K, uint16_t* out) { unpack_pairs(pk, 0, K / 2, out); }

// the group's 16 scales and 16 (minimum - 128 * scale) in fp32, from the stored fp16 scale and minimum
AVX512BF16 inline void load_sm(const uint16_t* sm, int g, __m512& s, __m512& m) {
  s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sm + (g * 2) * NB)));
  const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sm + (g * 2 + 1) * NB)));
  m = _mm512_fnmadd_ps(_mm512_set1_ps(128.0f), s, mn);
}

// the scales of a column block for affine512's rows, one type for both bf16-tile linears (so each
// row count's tile is compiled once): a Q4_1 block's fp16 table (sm: the group's scale, and its
// minimum less 128 * scale, the codes having been unpacked as 128 + code: load_sm), or the int8
// linear's fp32 scale per output channel (per_channel; G = 1, no minimum). A run-time branch, the
// same for every group of a call.
struct LinearScales {
  const uint16_t* sm;
  const float* per_channel;
  bool has_min() const { return sm != nullptr; }
};

AVX512BF16 inline __m512 scale16(const LinearScales& sc, int g) {
  if (!sc.sm) return _mm512_loadu_ps(sc.per_channel);
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc.sm + (g * 2) * NB)));
}

AVX512BF16 inline __m512 min16(const LinearScales& sc, int g) {
  __m512 s, m;
  load_sm(sc.sm, g, s, m);
  return m;
}

struct alignas(64) TileConfig {   // the LDTILECFG memory operand (palette 1)
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

bool amx_permitted() {
  // Linux hands out the AMX tile state only on request (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

AMXBF16 void amx_config(int mt) {
  // two sets of tiles, used for even and odd groups so one group's products overlap the previous
  // group's scaling: C (mt x 16 fp32), A (mt x 32 bf16), B (16 pairs x 16 columns x 2 bf16)
  static thread_local TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int set = 0; set < 2; ++set) {
    cfg.rows[3 * set + 0] = mt; cfg.colsb[3 * set + 0] = NB * 4;
    cfg.rows[3 * set + 1] = mt; cfg.colsb[3 * set + 1] = GROUP * 2;
    cfg.rows[3 * set + 2] = PAIRS; cfg.colsb[3 * set + 2] = 64;
  }
  _tile_loadconfig(&cfg);
}

AVX512BF16 inline void scale_rows(const float* dot, const float* xs, int G, int g, int mt, const uint16_t* sm,
                                  __m512* acc) {
  __m512 s, m;
  load_sm(sm, g, s, m);
  for (int r = 0; r < mt; ++r)
    acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[r * G + g]), _mm512_fmadd_ps(_mm512_load_ps(dot + r * NB), s, acc[r]));
}

// `pk` non-null: unpack each group's codes into Q right before its tile product (one row tile only:
// the memory stream of the next group overlaps this group's products); the arithmetic per row is the
// same either way
AMXBF16 void rows_amx(const uint16_t* x, const float* xs, int mt, int K, uint16_t* Q, const uint16_t* sm,
                      float* y, int N, const uint8_t* pk = nullptr) {
  alignas(64) float dot0[16 * NB], dot1[16 * NB];
  const int G = K / GROUP;
  __m512 acc[16];
  for (int r = 0; r < mt; ++r) acc[r] = _mm512_setzero_ps();
  // groups in pairs: the products of group g+1 run while group g's are scaled. With `pk`, codes are
  // unpacked one pair of groups ahead, so the tile loads never wait on stores just issued and the
  // next groups' memory stream overlaps this pair's products.
  if (pk) unpack_pairs(pk, 0, std::min(G, 2) * PAIRS, Q);
  int g = 0;
  for (; g + 1 < G; g += 2) {
    _tile_zero(0);
    _tile_loadd(1, x + g * GROUP, K * 2);
    _tile_loadd(2, Q + g * PAIRS * 32, 64);
    _tile_dpbf16ps(0, 1, 2);
    _tile_zero(3);
    _tile_loadd(4, x + (g + 1) * GROUP, K * 2);
    _tile_loadd(5, Q + (g + 1) * PAIRS * 32, 64);
    _tile_dpbf16ps(3, 4, 5);
    if (pk && g + 2 < G) unpack_pairs(pk, (g + 2) * PAIRS, std::min(G, g + 4) * PAIRS, Q);
    _tile_stored(0, dot0, NB * 4);
    scale_rows(dot0, xs, G, g, mt, sm, acc);
    _tile_stored(3, dot1, NB * 4);
    scale_rows(dot1, xs, G, g + 1, mt, sm, acc);
  }
  if (g < G) {
    _tile_zero(0);
    _tile_loadd(1, x + g * GROUP, K * 2);
    _tile_loadd(2, Q + g * PAIRS * 32, 64);
    _tile_dpbf16ps(0, 1, 2);
    _tile_stored(0, dot0, NB * 4);
    scale_rows(dot0, xs, G, g, mt, sm, acc);
  }
  for (int r = 0; r < mt; ++r) _mm512_storeu_ps(y + static_cast<int64_t>(r) * N, acc[r]);
}

AMXBF16 void amx_release() { _tile_release(); }

// --- many rows (prefill) on AMX: WIDE column blocks per row tile ------------------------------------
// rows_amx above keeps one column block's accumulators in registers, but each group's tile product
// then waits on the previous group's store and scaling (the tiles are not renamed): fine for the
// decode stream, ~5x off the tile unit's rate for a 1,000-row prefill. Here one A tile (16 rows x
// one group of inputs) feeds WIDE column blocks' products back to back, then their dot products are
// stored and scaled into accumulators in L1 while the next group's products run. Per row and column
// the arithmetic is rows_amx's exactly (the group's dot product from one tile product into a zeroed
// tile, then acc = minimum * sum(x) + (dot * scale + acc), groups in order), so a row's numbers do
// not depend on which path or how many rows the call had.
constexpr int WIDE = 4;

AMXBF16 void amx_config_wide(int mt) {
  static thread_local TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int j = 0; j < WIDE; ++j) { cfg.rows[j] = mt; cfg.colsb[j] = NB * 4; }   // C0..C3: mt x 16 fp32
  cfg.rows[4] = mt; cfg.colsb[4] = GROUP * 2;                                   // A: mt x 32 bf16
  for (int t = 5; t < 7; ++t) { cfg.rows[t] = PAIRS; cfg.colsb[t] = 64; }       // B: 16 pairs x 16 x 2
  _tile_loadconfig(&cfg);
}

// per column block and group: the scale and (minimum - 128 * scale) in fp32, as load_sm forms them
AVX512BF16 void scale_table(const uint16_t* sm, int G, float* out) {
  for (int g = 0; g < G; ++g) {
    __m512 s, m;
    load_sm(sm, g, s, m);
    _mm512_store_ps(out + g * 2 * NB, s);
    _mm512_store_ps(out + g * 2 * NB + NB, m);
  }
}

// Q: WIDE unpacked column blocks, K/2 pairs x 16 x 2 each; smf: their scale tables (scale_table)
AMXBF16 void rows_amx_wide(const uint16_t* x, const float* xs, int mt, int K, const uint16_t* Q,
                           const float* smf, float* y, int N) {
  const int G = K / GROUP;
  const int64_t qstride = static_cast<int64_t>(K) * NB, sstride = static_cast<int64_t>(G) * 2 * NB;
  alignas(64) float acc[16][WIDE * NB];
  alignas(64) float dot[WIDE][16 * NB];
  for (int r = 0; r < mt; ++r)
    for (int j = 0; j < WIDE; ++j) _mm512_store_ps(&acc[r][j * NB], _mm512_setzero_ps());
  for (int g = 0; g < G; ++g) {
    const int64_t qo = static_cast<int64_t>(g) * PAIRS * 32;
    _tile_loadd(4, x + g * GROUP, K * 2);
    _tile_zero(0);
    _tile_loadd(5, Q + qo, 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_zero(1);
    _tile_loadd(6, Q + qstride + qo, 64);
    _tile_dpbf16ps(1, 4, 6);
    _tile_zero(2);
    _tile_loadd(5, Q + 2 * qstride + qo, 64);
    _tile_dpbf16ps(2, 4, 5);
    _tile_zero(3);
    _tile_loadd(6, Q + 3 * qstride + qo, 64);
    _tile_dpbf16ps(3, 4, 6);
    _tile_stored(0, dot[0], NB * 4);
    _tile_stored(1, dot[1], NB * 4);
    _tile_stored(2, dot[2], NB * 4);
    _tile_stored(3, dot[3], NB * 4);
    for (int j = 0; j < WIDE; ++j) {
      const __m512 s = _mm512_load_ps(smf + j * sstride + g * 2 * NB), m = _mm512_load_ps(smf + j * sstride + g * 2 * NB + NB);
      for (int r = 0; r < mt; ++r) {
        float* a = &acc[r][j * NB];
        _mm512_store_ps(a, _mm512_fmadd_ps(m, _mm512_set1_ps(xs[r * G + g]),
                                           _mm512_fmadd_ps(_mm512_load_ps(dot[j] + r * NB), s, _mm512_load_ps(a))));
      }
    }
  }
  for (int r = 0; r < mt; ++r)
    for (int j = 0; j < WIDE; ++j)
      _mm512_storeu_ps(y + static_cast<int64_t>(r) * N + j * NB, _mm512_load_ps(&acc[r][j * NB]));
}

// --- int8, one scale per output channel (the LM head) ---------------------------------------------
// q8: int8 [N/16, K/2, 16, 2] (pair layout), scale: float [N]. y = scale[n] * (x . q[n]): the codes
// are exact in bf16, the dot products accumulate in fp32 over all of K, one multiply at the end.
AVX512BF16 void unpack_int8(const int8_t* q8, int K, uint16_t* out) {
  const int P = K / 2;
  for (int p = 0; p < P; ++p) {
    prefetch_weights(q8 + p * 32 + PREFETCH_BYTES);
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q8 + p * 32));
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1)));
    _mm512_store_si512(out + p * 32, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}

AMXBF16 void amx_config8(int mt) {
  static thread_local TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  cfg.rows[0] = mt; cfg.colsb[0] = NB * 4;        // C: mt x 16 fp32, accumulated over all of K
  cfg.rows[1] = mt; cfg.colsb[1] = GROUP * 2;     // A: mt x 32 bf16
  cfg.rows[2] = PAIRS; cfg.colsb[2] = 64;         // B: 16 pairs x 16 columns x 2
  _tile_loadconfig(&cfg);
}

AMXBF16 void rows_amx8(const uint16_t* x, int mt, int K, const uint16_t* Q, const float* scale, float* y, int N) {
  alignas(64) float dot[16 * NB];
  _tile_zero(0);
  for (int g = 0; g < K / GROUP; ++g) {
    _tile_loadd(1, x + g * GROUP, K * 2);
    _tile_loadd(2, Q + g * PAIRS * 32, 64);
    _tile_dpbf16ps(0, 1, 2);
  }
  _tile_stored(0, dot, NB * 4);
  const __m512 s = _mm512_loadu_ps(scale);
  for (int r = 0; r < mt; ++r) _mm512_storeu_ps(y + static_cast<int64_t>(r) * N, _mm512_mul_ps(_mm512_load_ps(dot + r * NB), s));
}

}  // namespace

torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& q8, const torch::Tensor& scale, bool use_amx) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.is_contiguous(), "x: contiguous bf16 [M, K]");
  TORCH_CHECK(q8.dim() == 4 && q8.size(2) == NB && q8.size(3) == 2 && q8.scalar_type() == torch::kChar, "q8 layout");
  const int M = x.size(0), K = x.size(1);
  const int blocks = q8.size(0), N = blocks * NB;
  TORCH_CHECK(q8.size(1) * 2 == K && K % GROUP == 0, "K mismatch");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat && scale.numel() == N, "scale: float [N]");
  auto y = new_empty({M, N}, x.options().dtype(torch::kFloat));
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const int8_t* qp = q8.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const bool amx = use_amx && amx_permitted();
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    Aligned<uint16_t> tile_mem(static_cast<size_t>(K) * NB);
    uint16_t* tile = tile_mem.p;
    int configured = 0;
    for (int64_t b = b0; b < b1; ++b) {
      unpack_int8(qp + b * static_cast<int64_t>(K) * NB, K, tile);
      for (int m0 = 0; m0 < M; m0 += 16) {
        const int mt = std::min(16, M - m0);
        float* yb = yp + static_cast<int64_t>(m0) * N + b * NB;
        const uint16_t* xb = xp + static_cast<int64_t>(m0) * K;
        if (amx) {
          if (configured != mt) { amx_config8(mt); configured = mt; }
          rows_amx8(xb, mt, K, tile, sp + b * NB, yb, N);
        } else {
          affine512::rows_any(mt, xb, nullptr, K, K, tile, LinearScales{nullptr, sp + b * NB}, yb, N);
        }
      }
    }
    if (configured) amx_release();
  });
  return y;
}

torch::Tensor int4_linear(const torch::Tensor& x, const torch::Tensor& nibbles, const torch::Tensor& sm,
                          bool use_amx) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.is_contiguous(), "x: contiguous bf16 [M, K]");
  TORCH_CHECK(nibbles.dim() == 3 && nibbles.size(2) == NB && nibbles.scalar_type() == torch::kByte, "nibbles layout");
  const int M = x.size(0), K = x.size(1);
  const int blocks = nibbles.size(0), N = blocks * NB;
  TORCH_CHECK(nibbles.size(1) * 2 == K && K % GROUP == 0, "K mismatch");
  TORCH_CHECK(sm.scalar_type() == torch::kHalf && sm.is_contiguous(), "sm: contiguous fp16");
  const int G = K / GROUP;
  auto y = new_empty({M, N}, x.options().dtype(torch::kFloat));
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  // per row and group: the sum of the inputs (the minimums' share), from the same bf16 values, in a
  // fixed order (a row's sums do not depend on the other rows)
  std::vector<float> xs_mem(static_cast<size_t>(M) * G);
  for_rows(M, [&](int64_t r) { affine512::group_sums(xp + r * K, K, GROUP, xs_mem.data() + r * G); });
  const float* xsp = xs_mem.data();
  const uint8_t* pk = nibbles.data_ptr<uint8_t>();
  const uint16_t* smp = reinterpret_cast<const uint16_t*>(sm.data_ptr<at::Half>());
  float* yp = y.data_ptr<float>();
  const bool amx = use_amx && amx_permitted();
  if (amx && M > 16 && blocks % WIDE == 0) {
    // many rows: tasks of WIDE column blocks x up to WIDE_ROWS rows; each task unpacks its blocks once
    constexpr int64_t WIDE_ROWS = 256;
    const int64_t sets = blocks / WIDE, chunks = (M + WIDE_ROWS - 1) / WIDE_ROWS;
    at::parallel_for(0, sets * chunks, 1, [&](int64_t t0, int64_t t1) {
      Aligned<uint16_t> tile_mem(static_cast<size_t>(K) * NB * WIDE);
      std::unique_ptr<float, decltype(&std::free)> smf(static_cast<float*>(std::aligned_alloc(64, sizeof(float) * WIDE * G * 2 * NB)), &std::free);
      int configured = 0;
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t set = t / chunks, r_begin = (t % chunks) * WIDE_ROWS, r_end = std::min<int64_t>(M, r_begin + WIDE_ROWS);
        for (int j = 0; j < WIDE; ++j) {
          unpack_codes(pk + (set * WIDE + j) * (K / 2) * NB, K, tile_mem.p + static_cast<int64_t>(j) * K * NB);
          scale_table(smp + (set * WIDE + j) * G * 2 * NB, G, smf.get() + static_cast<int64_t>(j) * G * 2 * NB);
        }
        for (int64_t m0 = r_begin; m0 < r_end; m0 += 16) {
          const int mt = static_cast<int>(std::min<int64_t>(16, r_end - m0));
          if (configured != mt) { amx_config_wide(mt); configured = mt; }
          rows_amx_wide(xp + m0 * K, xsp + m0 * G, mt, K, tile_mem.p, smf.get(),
                        yp + m0 * N + set * WIDE * NB, N);
        }
      }
      if (configured) amx_release();
    });
    return y;
  }
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    Aligned<uint16_t> tile_mem(static_cast<size_t>(K) * NB);
    uint16_t* tile = tile_mem.p;
    int configured = 0;
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* pkb = pk + b * (K / 2) * NB;
      const uint16_t* smb = smp + b * G * 2 * NB;
      if (amx && M <= 16) {                          // one row tile: unpack group by group
        if (M == 0) continue;
        if (configured != M) { amx_config(M); configured = M; }
        rows_amx(xp, xsp, M, K, tile, smb, yp + b * NB, N, pkb);
        continue;
      }
      unpack_codes(pkb, K, tile);
      for (int m0 = 0; m0 < M; m0 += 16) {
        const int mt = std::min(16, M - m0);
        float* yb = yp + static_cast<int64_t>(m0) * N + b * NB;
        const uint16_t* xb = xp + static_cast<int64_t>(m0) * K;
        if (amx) {
          if (configured != mt) { amx_config(mt); configured = mt; }
          rows_amx(xb, xsp + m0 * G, mt, K, tile, smb, yb, N);
        } else {
          affine512::rows_any(mt, xb, xsp + m0 * G, K, GROUP, tile, LinearScales{smb, nullptr}, yb, N);
        }
      }
    }
    if (configured) amx_release();
  });
  return y;
}

// --- row-invariant attention ------------------------------------------------------------------------
// Every query row attends alone over exactly its own keys (no padding, no mask), with a fixed order
// of operations, so a verified token's attention output is bit for bit what decoding it alone gives
// (the row-invariance speculation on bf16-activation targets needs). One call covers every row of
// the step (instead of one SDPA call per row and layer). fp32 K/V cache, head_dim a multiple of 16.
namespace {

#define AVX512F __attribute__((target("avx512f,avx512dq")))

AVX512F inline __m512 exp512(__m512 x) {
  // e^x = 2^n e^r, n = round(x log2 e), |r| <= ln2 / 2, Cephes' degree-6 polynomial for e^r
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// one query row, one KV head, its G query heads: out[g] = softmax(scale q_g . K^T) V over `len` keys
// 16 cache values widened to fp32 (exact for every cache dtype, so a 16-bit cache read here gives the
// same scores as the same values stored in fp32)
AVX512F inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
AVX512F inline __m512 load16(const at::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
AVX512F inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// 16 vectors -> one: lane j = the sum of a[j]'s 16 lanes (a transpose-and-add network in a fixed
// order; ~3 instructions per result instead of one horizontal reduction each)
AVX512F inline __m512 sum16(__m512* a) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(b[2 * i]), _mm512_castps_pd(b[2 * i + 1]));
    const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(b[2 * i]), _mm512_castps_pd(b[2 * i + 1]));
    c[i] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));   // segment s: keys 4i..4i+3, part s
  }
  const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
  const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, 0x88), _mm512_shuffle_f32x4(d0, d1, 0xDD));
}

// n (<= 16 * KB) cache rows of one KV head widened to fp32, row after row, D values each
template <typename T, int DV>
AVX512F inline void widen_rows(const T* c, const int64_t* slots, int n, int64_t slot_stride, float* dst) {
  for (int j = 0; j < n; ++j) {
    const T* src = c + slots[j] * slot_stride;
    for (int v = 0; v < DV; ++v) _mm512_storeu_ps(dst + j * DV * 16 + v * 16, load16(src + v * 16));
  }
}

// one key's 16 lane partials of q . k: lane l sums q[16c + l] k[16c + l] over the chunks c in order
template <int DV>
AVX512F inline __m512 dot_chunks(const __m512* qv, const float* k) {
  __m512 a = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
#pragma GCC unroll 16
  for (int c = 1; c < DV; ++c) a = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k + c * 16), a);
  return a;
}

// Tiles of at least this many pairs score their keys transposed, for heads of 32 to 128 values
// (measured one layer of a 1,000-token prefill at 1 thread: 64 values 17-19 -> 14 ms, 128 values
// 36 -> 34 ms; 256 values 26 -> 29 ms, where sum16's shuffles are already spread over 16 chunks;
// at 8-24 pairs, verification's tiles, either path costs the same)
constexpr int ATTN_TRANSPOSED_PAIRS = 32;

// r[j] = row j of a 16 x 16 block -> r[i] = its column i (lane j: row j's value i)
AVX512F inline void transpose16(__m512* r) {
  __m512 t[16];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    r[4 * i + 0] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h)
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      t[8 * h + i] = _mm512_shuffle_f32x4(r[8 * h + i], r[8 * h + 4 + i], 0x88);
      t[8 * h + 4 + i] = _mm512_shuffle_f32x4(r[8 * h + i], r[8 * h + 4 + i], 0xDD);
    }
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
    r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xDD);
  }
}

// n (<= 16) cache rows of one KV head widened to fp32 and transposed: kt[d * 16 + j] = key j's
// value d (keys past n are zero)
template <typename T, int DV>
AVX512F inline void transposed_keys(const T* c, const int64_t* slots, int n, int64_t slot_stride, float* kt) {
  for (int ch = 0; ch < DV; ++ch) {
    __m512 r[16];
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) r[j] = j < n ? load16(c + slots[j] * slot_stride + ch * 16) : _mm512_setzero_ps();
    transpose16(r);
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) _mm512_storeu_ps(kt + (ch * 16 + i) * 16, r[i]);
  }
}

// Up to 4 pairs' partial scores t_g against one block of 16 keys held transposed (kt, above), lane j
// key j's, summed as dot_chunks and sum16 sum them, so a pair's bits are the same on either path:
// lane l's partial x_l = q_l k_l + q_(16+l) k_(16+l) + ... over the chunks in order, then
// t_g = (x_4g + x_4g+2) + (x_4g+1 + x_4g+3) per group g of four lanes (score_group adds the t_g).
// Each transposed key row is loaded once for the PB pairs (sum16's shuffles are not needed: the
// keys already lie across the lanes). One group per call, not inlined: unrolled whole, the
// compiler hoists every load ahead of the multiplies and spills them.
template <int DV, int PB>
__attribute__((noinline)) AVX512F void lane_group_sums(const AttnPair* pairs, const float* kt, int g, __m512* t) {
  __m512 x[4][PB];
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    const __m512 kd = _mm512_loadu_ps(kt + (4 * g + i) * 16);
#pragma GCC unroll 4
    for (int p = 0; p < PB; ++p) x[i][p] = _mm512_mul_ps(_mm512_set1_ps(pairs[p].q[4 * g + i]), kd);
  }
#pragma GCC unroll 16
  for (int c = 1; c < DV; ++c)
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const int d = 16 * c + 4 * g + i;
      const __m512 kd = _mm512_loadu_ps(kt + d * 16);
#pragma GCC unroll 4
      for (int p = 0; p < PB; ++p) x[i][p] = _mm512_fmadd_ps(_mm512_set1_ps(pairs[p].q[d]), kd, x[i][p]);
    }
#pragma GCC unroll 4
  for (int p = 0; p < PB; ++p) t[p] = _mm512_add_ps(_mm512_add_ps(x[0][p], x[2][p]), _mm512_add_ps(x[1][p], x[3][p]));
}

// the scores of pairs [0, PB) of a group against the key block at j0 (transposed in kt): the four
// lane groups' sums, then (t_0 + t_1) + (t_2 + t_3), stored and folded into the running lane maxima
// as the untransposed path does (not inlined: inlined, the compiler keeps the key rows in registers
// across the groups and spills the sums)
template <int DV, int PB>
__attribute__((noinline)) AVX512F void score_group(const AttnPair* pairs, int64_t j0, const float* kt, __m512 scale_v,
                                                   float* scores, int64_t stride, float* mx_buf) {
  __m512 t[4][PB];
  for (int g = 0; g < 4; ++g) lane_group_sums<DV, PB>(pairs, kt, g, t[g]);
#pragma GCC unroll 4
  for (int p = 0; p < PB; ++p) {
    if (pairs[p].len <= j0) continue;
    const int n = static_cast<int>(std::min<int64_t>(16, pairs[p].len - j0));
    const __mmask16 m = n == 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
    const __m512 s = _mm512_add_ps(_mm512_add_ps(t[0][p], t[1][p]), _mm512_add_ps(t[2][p], t[3][p]));
    const __m512 sc = _mm512_mul_ps(s, scale_v);
    _mm512_mask_storeu_ps(scores + p * stride + j0, m, sc);
    const __m512 mxv = _mm512_loadu_ps(mx_buf + p * 16);
    _mm512_storeu_ps(mx_buf + p * 16, _mm512_mask_max_ps(mxv, m, mxv, sc));
  }
}

// pairs [0, pb) of a group (pb <= PB) scored by the group kernel of that size
template <int DV, int PB>
AVX512F void score_group_any(int pb, const AttnPair* pairs, int64_t j0, const float* kt, __m512 scale_v, float* scores,
                             int64_t stride, float* mx_buf) {
  if constexpr (PB > 1) {
    if (pb < PB) return score_group_any<DV, PB - 1>(pb, pairs, j0, kt, scale_v, scores, stride, mx_buf);
  }
  score_group<DV, PB>(pairs, j0, kt, scale_v, scores, stride, mx_buf);
}

// H pairs' value sums over keys [j0, j1) (kv: those keys' values in fp32), in key order: each
// pair's sums start from its running sums in acc (zero at the first block) and go back there. The
// keys every pair reads are done together, H pairs per value load; then each pair's own last keys.
template <int DV, int H, typename VT>
AVX512F void values_block(const AttnPair* pairs, const float* scores, int64_t stride, const ValueRows<VT>& kv,
                          int64_t j0, int64_t j1, float* acc) {
  constexpr int D = DV * 16;
  __m512 o[H * DV];
  int64_t common = j1;
#pragma GCC unroll 16
  for (int h = 0; h < H; ++h) {
    common = std::min(common, pairs[h].len);
#pragma GCC unroll 16
    for (int c = 0; c < DV; ++c) o[h * DV + c] = j0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + h * D + c * 16);
  }
  for (int64_t jj = j0; jj < common; ++jj) {
    const VT* vj = kv.row(jj - j0, jj);
    __m512 v[DV];
#pragma GCC unroll 16
    for (int c = 0; c < DV; ++c) v[c] = load16(vj + c * 16);
#pragma GCC unroll 16
    for (int h = 0; h < H; ++h) {
      const __m512 pj = _mm512_set1_ps(scores[h * stride + jj]);
#pragma GCC unroll 16
      for (int c = 0; c < DV; ++c) o[h * DV + c] = _mm512_fmadd_ps(pj, v[c], o[h * DV + c]);
    }
  }
#pragma GCC unroll 16
  for (int h = 0; h < H; ++h) {
    const int64_t end = std::min(j1, pairs[h].len);
    for (int64_t jj = std::max(j0, common); jj < end; ++jj) {
      const __m512 pj = _mm512_set1_ps(scores[h * stride + jj]);
#pragma GCC unroll 16
      for (int c = 0; c < DV; ++c)
        o[h * DV + c] = _mm512_fmadd_ps(pj, load16(kv.row(jj - j0, jj) + c * 16), o[h * DV + c]);
    }
#pragma GCC unroll 16
    for (int c = 0; c < DV; ++c) _mm512_storeu_ps(acc + h * D + c * 16, o[h * DV + c]);
  }
}

template <int DV, int HB, typename VT>
AVX512F void values_any(int h, const AttnPair* pairs, const float* scores, int64_t stride, const ValueRows<VT>& kv,
                        int64_t j0, int64_t j1, float* acc) {
  if constexpr (HB > 1) {
    if (h < HB) return values_any<DV, HB - 1, VT>(h, pairs, scores, stride, kv, j0, j1, acc);
  }
  values_block<DV, HB, VT>(pairs, scores, stride, kv, j0, j1, acc);
}

// one tile (common.h): every pair p's out = softmax(scale q_p . K^T) V over its first len_p keys.
// Per pair, as a tile of one pair would: scores 16 keys at a time (a product chain over the head's
// 16-lane chunks, then sum16), their lane-wise maximum block by block, e^(s - max) and its sum in key
// order, then the values summed in key order, HB pairs per value load, and one division. DV = D / 16.
// A tile of many pairs (a prefill's) transposes each key block once and scores 4 pairs per key row
// with the same sums (score_group), so its bits are those of a tile of one pair.
template <typename T, int DV>
AVX512F void attend_tile(const AttnPair* pairs, int P, int64_t max_len, const T* kc, const T* vc,
                         const int64_t* slots, int64_t slot_stride, float scale, float* scores, int64_t stride,
                         float* kv, float* acc_buf, float* mx_buf) {
  constexpr int D = DV * 16, HB = DV >= 16 ? 1 : 16 / DV;
  constexpr int VB = D >= 256 ? 16 : 4096 / D;            // values per block: 16 KB of fp32
  const __m512 scale_v = _mm512_set1_ps(scale);
  const bool transposed = DV >= 2 && DV <= 8 && P >= ATTN_TRANSPOSED_PAIRS;
  for (int p = 0; p < P; ++p) _mm512_storeu_ps(mx_buf + p * 16, _mm512_set1_ps(-INFINITY));
  prefetch_rows(kc, slots, 0, std::min(max_len, ATTN_PREFETCH_KEYS), slot_stride, D);
  for (int64_t j0 = 0; j0 < max_len; j0 += 16) {
    // the keys ATTN_PREFETCH_KEYS ahead, and this block's values (summed after the scores)
    prefetch_rows(kc, slots, std::min(max_len, j0 + ATTN_PREFETCH_KEYS), std::min(max_len, j0 + ATTN_PREFETCH_KEYS + 16),
                  slot_stride, D);
    prefetch_rows(vc, slots, j0, std::min(max_len, j0 + 16), slot_stride, D);
    const int nk = static_cast<int>(std::min<int64_t>(16, max_len - j0));
    if (transposed) {                        // many pairs: the block transposed once, 4 pairs per key row
      transposed_keys<T, DV>(kc, slots + j0, nk, slot_stride, kv);
      for (int p0 = 0; p0 < P; p0 += 4)
        score_group_any<DV, 4>(std::min(4, P - p0), pairs + p0, j0, kv, scale_v, scores + p0 * stride, stride,
                               mx_buf + p0 * 16);
      continue;
    }
    widen_rows<T, DV>(kc, slots + j0, nk, slot_stride, kv);
    for (int p = 0; p < P; ++p) {
      if (pairs[p].len <= j0) continue;
      const int n = static_cast<int>(std::min<int64_t>(16, pairs[p].len - j0));
      __m512 qv[DV];
#pragma GCC unroll 16
      for (int c = 0; c < DV; ++c) qv[c] = _mm512_loadu_ps(pairs[p].q + c * 16);
      __m512 acc[16];
      if (n == 16) {                         // a whole block: straight-line code, acc in registers
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) acc[j] = dot_chunks<DV>(qv, kv + j * D);
      } else {
        for (int j = 0; j < 16; ++j) acc[j] = j < n ? dot_chunks<DV>(qv, kv + j * D) : _mm512_setzero_ps();
      }
      const __mmask16 m = n == 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
      const __m512 sc = _mm512_mul_ps(sum16(acc), scale_v);
      _mm512_mask_storeu_ps(scores + p * stride + j0, m, sc);
      const __m512 mxv = _mm512_loadu_ps(mx_buf + p * 16);
      _mm512_storeu_ps(mx_buf + p * 16, _mm512_mask_max_ps(mxv, m, mxv, sc));
    }
  }
  for (int p = 0; p < P; ++p) {
    float* sg = scores + p * stride;
    const int64_t len = pairs[p].len;
    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(_mm512_loadu_ps(mx_buf + p * 16)));
    __m512 sumv = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= len; j += 16) {
      const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(sg + j), mx));
      _mm512_storeu_ps(sg + j, e);
      sumv = _mm512_add_ps(sumv, e);
    }
    if (j < len) {
      const __mmask16 m = static_cast<__mmask16>((1u << (len - j)) - 1);
      const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sg + j), mx));
      _mm512_mask_storeu_ps(sg + j, m, e);
      sumv = _mm512_add_ps(sumv, _mm512_maskz_mov_ps(m, e));
    }
    mx_buf[p] = 1.0f / _mm512_reduce_add_ps(sumv);     // the pair's 1 / sum (its maximum is spent)
  }
  // the values VB keys at a time, widened to fp32 once for every pair (their exact values: the same
  // sums as reading the cache's own rows). Summing straight from the cache for a tile of few pairs
  // ran no faster (SmolLM2, Zen 4) and, instanced per cache type, cost a fifth of this file's
  // compile time on a first start.
  for (int64_t j0 = 0; j0 < max_len; j0 += VB) {
    const int64_t j1 = std::min<int64_t>(max_len, j0 + VB);
    widen_rows<T, DV>(vc, slots + j0, static_cast<int>(j1 - j0), slot_stride, kv);
    for (int p0 = 0; p0 < P; p0 += HB)
      values_any<DV, HB, float>(std::min(HB, P - p0), pairs + p0, scores + p0 * stride, stride,
                                ValueRows<float>{kv, nullptr, D}, j0, j1, acc_buf + p0 * D);
  }
  for (int p = 0; p < P; ++p) {
    const __m512 invv = _mm512_set1_ps(mx_buf[p]);
    for (int c = 0; c < DV; ++c)
      _mm512_storeu_ps(pairs[p].out + c * 16, _mm512_mul_ps(_mm512_loadu_ps(acc_buf + p * D + c * 16), invv));
  }
}

template <typename T>
void attend_tile_any(int D, const AttnPair* pairs, int P, int64_t max_len, const T* kc, const T* vc,
                     const int64_t* slots, int64_t slot_stride, float scale, float* scores, int64_t stride, float* kv,
                     float* acc_buf, float* mx_buf) {
  switch (D / 16) {
#define CASE(n) case n: attend_tile<T, n>(pairs, P, max_len, kc, vc, slots, slot_stride, scale, scores, stride, kv, \
                                          acc_buf, mx_buf); break;
    CASE(1) CASE(2) CASE(4) CASE(8) CASE(16)
#undef CASE
    default: TORCH_CHECK(false, "attend_rows: head_dim ", D, " is not supported");
  }
}

}  // namespace

void attend_rows(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                 torch::Tensor& out, const std::vector<int64_t>& rows, const std::vector<int64_t>& lens,
                 const std::vector<int64_t>& slot_lists, const std::vector<torch::Tensor>& slots, double scale) {
  attend_rows_any(q, k_cache, v_cache, out, rows, lens, slot_lists, slots, scale, [](auto tag, auto&&... args) {
    attend_tile_any<typename decltype(tag)::type>(args...);
  });
}

// --- a decoder layer's elementwise work (layer.h calls these) -------------------------------------
namespace {

// n fp32 values -> bf16, round to nearest even, 16 at a time (the same results as to_bf16)
AVX512BF16 void to_bf16_n(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(src + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), reinterpret_cast<const __m256i&>(h));
  }
  for (; i < n; ++i) dst[i] = to_bf16(src[i]);
}


// out[r] = bf16(w * (x[r] / rms(x[r])))
AVX512F void rms_norm_row_bf16(const float* x, const float* w, int r, int H, float eps, uint16_t* out) {
  {
    const float* xr = x + static_cast<int64_t>(r) * H;
    __m512 acc = _mm512_setzero_ps();
    int i = 0;
    for (; i + 16 <= H; i += 16) {
      const __m512 v = _mm512_loadu_ps(xr + i);
      acc = _mm512_fmadd_ps(v, v, acc);
    }
    float ss = _mm512_reduce_add_ps(acc);
    for (; i < H; ++i) ss += xr[i] * xr[i];
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(H) + eps);
    uint16_t* o = out + static_cast<int64_t>(r) * H;
    alignas(64) float tmp[16];
    int j = 0;
    for (; j + 16 <= H; j += 16) {
      _mm512_store_ps(tmp, _mm512_mul_ps(_mm512_loadu_ps(w + j), _mm512_mul_ps(_mm512_loadu_ps(xr + j),
                                                                                _mm512_set1_ps(inv))));
      to_bf16_n(tmp, o + j, 16);
    }
    for (; j < H; ++j) o[j] = to_bf16(w[j] * (xr[j] * inv));
  }
}

// a gated MLP's activation, of 16 gate lanes and of one gate value (a row's tail)
struct SiluGate {                                 // silu(g) = g / (1 + exp(-g))
  AVX512F static __m512 lanes(__m512 g) {
    return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
  }
  static float one(float g) { return g / (1.0f + std::exp(-g)); }
};

// gelu_tanh: 0.5 g (1 + tanh(t)) written as g / (1 + exp(-2 t)), t = sqrt(2 / pi) (g + 0.044715 g^3),
// so one exp serves (a -2 t past exp's range gives the limit, -0 or a tiny quotient)
struct GeluGate {
  AVX512F static __m512 lanes(__m512 g) {
    const __m512 g3 = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
    const __m512 t = _mm512_mul_ps(_mm512_set1_ps(GELU_K), _mm512_fmadd_ps(_mm512_set1_ps(GELU_C), g3, g));
    const __m512 e = exp512(_mm512_mul_ps(_mm512_set1_ps(-2.0f), t));
    return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
  }
  static float one(float g) { return gelu_tanh(g); }
};

// out = bf16(act(gate) * up) for one row of [gate | up] (I each), 16 lanes at a time
template <typename Act>
AVX512F void gated_mul_row(const float* gu, int I, uint16_t* out) {
  const float* g = gu;
  const float* u = gu + I;
  alignas(64) float tmp[16];
  int i = 0;
  for (; i + 16 <= I; i += 16) {
    _mm512_store_ps(tmp, _mm512_mul_ps(Act::lanes(_mm512_loadu_ps(g + i)), _mm512_loadu_ps(u + i)));
    to_bf16_n(tmp, out + i, 16);
  }
  for (; i < I; ++i) out[i] = to_bf16(Act::one(g[i]) * u[i]);
}

AVX512F void silu_mul_row(const float* gu, int I, uint16_t* out) { gated_mul_row<SiluGate>(gu, I, out); }
AVX512F void gelu_mul_row(const float* gu, int I, uint16_t* out) { gated_mul_row<GeluGate>(gu, I, out); }


}  // namespace

// --- greedy: the argmax of every logits row ----------------------------------------------------------
namespace {

// index of the first maximum of x[0, n) (torch.argmax's rules: the first maximum; a NaN counts as
// the maximum, so the first NaN wins), 16 lanes at a time
AVX512F int64_t argmax_row(const float* x, int64_t n) {
  int64_t i = 0, best_i = 0;
  float best = -INFINITY;
  __mmask16 nan = 0;
  if (n >= 16) {
    __m512 vmax = _mm512_loadu_ps(x);
    nan |= _mm512_cmp_ps_mask(vmax, vmax, _CMP_UNORD_Q);
    __m512i vidx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i cur = vidx;
    const __m512i step = _mm512_set1_epi32(16);
    for (i = 16; i + 16 <= n; i += 16) {
      cur = _mm512_add_epi32(cur, step);
      const __m512 v = _mm512_loadu_ps(x + i);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      const __mmask16 gt = _mm512_cmp_ps_mask(v, vmax, _CMP_GT_OQ);     // strictly greater: first index kept
      vmax = _mm512_mask_mov_ps(vmax, gt, v);
      vidx = _mm512_mask_mov_epi32(vidx, gt, cur);
    }
    alignas(64) float mv[16];
    alignas(64) int32_t mi[16];
    _mm512_store_ps(mv, vmax);
    _mm512_store_si512(reinterpret_cast<__m512i*>(mi), vidx);
    best = mv[0];
    best_i = mi[0];
    for (int l = 1; l < 16; ++l)
      if (mv[l] > best || (mv[l] == best && mi[l] < best_i)) { best = mv[l]; best_i = mi[l]; }
  }
  for (; i < n; ++i)
    if (x[i] > best || std::isnan(x[i])) {
      nan = nan || std::isnan(x[i]);
      best = x[i];
      best_i = i;
      if (nan) break;
    }
  if (nan)
    for (int64_t j = 0; j < n; ++j)
      if (std::isnan(x[j])) return j;
  return best_i;
}

}  // namespace

bool amx_available() { return amx_permitted(); }

}  // namespace draftwise

#include "layer.h"
