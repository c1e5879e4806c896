// The CPU kernels on AVX2 + FMA + F16C (Intel since Haswell, AMD since Zen: the laptop and desktop
// path), built with -mavx2 -mfma -mf16c and loaded only where the CPU has all three.
//
// The int4 linear (GGUF Q4_1 blocks, group 32) is affine.h's group-affine kernel reading the scales
// and minimums from their fp16 table; the int8 linear (one scale per output channel, the LM head of
// a re-quantized model) is below. There are no bf16 dot products here, so activations are widened to
// fp32 (exact) and each block of 16 output columns multiplies them on fp32 FMAs, the codes converted
// to fp32 (exact). A block's codes are converted once per call and serve every row (weight-
// stationary: unpacked in registers for up to 3 rows, into a per-thread fp32 tile for more); the
// arithmetic of a row is the same whichever tile or path computed it, so a row's bits never depend on
// how many rows shared the call: prefill chunks, decode and verification rows agree.
//
// The row-invariant attention, RMSNorm, SiLU-and-mul, bf16 rounding and the argmax follow the
// AVX-512 file's algorithms 8 lanes at a time (their results differ from it in rounding only).
#include "affine.h"
#include "avx2_q8act.h"

namespace draftwise {
namespace {

using affine::MT_MAX;

using affine::hsum8;
using affine::widen_bf16;

// --- int8, one scale per output channel (the LM head) ---------------------------------------------
// pair p holds 16 columns x (k = 2p, 2p + 1) interleaved: 4 vectors of (column, k parity) lanes.
// Per row 8 accumulators: even and odd pairs apart (two FMA chains per lane), summed at the end,
// then the parities of each column (one hadd) and the scale.
inline void unpack_pair8(const int8_t* q, __m256 w[4]) {
  for (int i = 0; i < 4; ++i)
    w[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + i * 8))));
}

inline void unpack_block8(const int8_t* q, int K, float* tile) {
  __m256 w[4];
  for (int p = 0; p < K / 2; ++p) {
    prefetch_weights(q + p * 32 + PREFETCH_BYTES);
    unpack_pair8(q + p * 32, w);
    for (int i = 0; i < 4; ++i) _mm256_store_ps(tile + p * 32 + i * 8, w[i]);
  }
}

template <int MT, bool TILE>
void rows_int8(const float* x, int K, const int8_t* q, const float* tile, const float* scale, float* y, int N) {
  __m256 acc[MT][2][4];
  for (int r = 0; r < MT; ++r)
    for (int e = 0; e < 2; ++e)
      for (int i = 0; i < 4; ++i) acc[r][e][i] = _mm256_setzero_ps();
  for (int p = 0; p < K / 2; ++p) {
    __m256 w[4];
    if (TILE) {
      for (int i = 0; i < 4; ++i) w[i] = _mm256_load_ps(tile + p * 32 + i * 8);
    } else {
      if ((p & 1) == 0) prefetch_weights(q + p * 32 + PREFETCH_BYTES);
      unpack_pair8(q + p * 32, w);
    }
    const int e = p & 1;
    for (int r = 0; r < MT; ++r) {
      // (x[2p], x[2p+1]) in every lane pair
      const __m256 xp = _mm256_castpd_ps(_mm256_broadcast_sd(reinterpret_cast<const double*>(x + r * K + 2 * p)));
      for (int i = 0; i < 4; ++i) acc[r][e][i] = _mm256_fmadd_ps(xp, w[i], acc[r][e][i]);
    }
  }
  const __m256 s0 = _mm256_loadu_ps(scale), s1 = _mm256_loadu_ps(scale + 8);
  for (int r = 0; r < MT; ++r) {
    __m256 a[4];
    for (int i = 0; i < 4; ++i) a[i] = _mm256_add_ps(acc[r][0][i], acc[r][1][i]);
    // hadd -> columns (0,1,4,5,2,3,6,7); the permute puts them in order
    const __m256 lo = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_hadd_ps(a[0], a[1])), 0xD8));
    const __m256 hi = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_hadd_ps(a[2], a[3])), 0xD8));
    _mm256_storeu_ps(y + static_cast<int64_t>(r) * N, _mm256_mul_ps(lo, s0));
    _mm256_storeu_ps(y + static_cast<int64_t>(r) * N + 8, _mm256_mul_ps(hi, s1));
  }
}

template <bool TILE>
void rows_int8_any(int mt, const float* x, int K, const int8_t* q, const float* tile, const float* scale, float* y,
                   int N) {
  switch (mt) {
    case 1: rows_int8<1, TILE>(x, K, q, tile, scale, y, N); break;
    case 2: rows_int8<2, TILE>(x, K, q, tile, scale, y, N); break;
    case 3: rows_int8<3, TILE>(x, K, q, tile, scale, y, N); break;
    default: break;
  }
}

// x bf16 [M, K] -> fp32 [M, K]
std::vector<float> widen_rows(const torch::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<float> xf(static_cast<size_t>(M * K));
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  for_rows(M, [&](int64_t r) { widen_bf16(xp + r * K, xf.data() + r * K, K); });
  return xf;
}

}  // namespace

torch::Tensor int4_linear(const torch::Tensor& x, const torch::Tensor& nibbles, const torch::Tensor& sm,
                          bool /*use_amx*/) {
  check_int4(x, nibbles, sm);
  const affine::F16PairScales sc{reinterpret_cast<const uint16_t*>(sm.data_ptr<at::Half>()),
                                 static_cast<int>(x.size(1) / GROUP)};
  return affine::linear<affine::Nibbles>(x, GROUP, nibbles.data_ptr<uint8_t>(), 0, sc, nibbles.size(0));
}

torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& q8, const torch::Tensor& scale,
                          bool /*use_amx*/) {
  check_int8(x, q8, scale);
  const int M = x.size(0), K = x.size(1), blocks = q8.size(0), N = blocks * NB;
  auto y = new_empty({M, N}, x.options().dtype(torch::kFloat));
  if (M == 0) return y;
  const std::vector<float> xf = widen_rows(x);
  const int8_t* qp = q8.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    std::unique_ptr<Aligned<float>> tile;
    if (M > MT_MAX) tile = std::make_unique<Aligned<float>>(static_cast<size_t>(K) * NB);
    for (int64_t b = b0; b < b1; ++b) {
      const int8_t* qb = qp + b * static_cast<int64_t>(K) * NB;
      if (!tile) {
        rows_int8_any<false>(M, xf.data(), K, qb, nullptr, sp + b * NB, yp + b * NB, N);
        continue;
      }
      unpack_block8(qb, K, tile->p);
      for (int m0 = 0; m0 < M; m0 += MT_MAX)
        rows_int8_any<true>(std::min(MT_MAX, M - m0), xf.data() + static_cast<int64_t>(m0) * K, K, qb, tile->p,
                            sp + b * NB, yp + static_cast<int64_t>(m0) * N + b * NB, N);
    }
  });
  return y;
}

// --- row-invariant attention ------------------------------------------------------------------------
// Every query row attends alone over exactly its own keys, in a fixed order of operations (see the
// AVX-512 file); here 8 keys are scored at a time.
namespace {

// e^x for x in [-87.3, 88.3] (clamped): 2^n e^r, n = round(x log2 e), Cephes' polynomial for e^r
inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// 8 cache values widened to fp32 (exact for every cache dtype)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline __m256 load8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// 8 vectors -> one: lane j = the sum of a[j]'s 8 lanes (a fixed hadd network)
inline __m256 sum8(const __m256* a) {
  const __m256 b0 = _mm256_hadd_ps(a[0], a[1]), b1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 b2 = _mm256_hadd_ps(a[4], a[5]), b3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 c0 = _mm256_hadd_ps(b0, b1), c1 = _mm256_hadd_ps(b2, b3);
  return _mm256_add_ps(_mm256_permute2f128_ps(c0, c1, 0x20), _mm256_permute2f128_ps(c0, c1, 0x31));
}

// lanes below n set (n in 0..8)
inline __m256 lanes_below(int n) {
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}

// n cache rows of one KV head widened to fp32, row after row, D = 8 DV values each
template <typename T, int DV>
inline void widen_rows(const T* c, const int64_t* slots, int n, int64_t slot_stride, float* dst) {
  for (int j = 0; j < n; ++j) {
    const T* src = c + slots[j] * slot_stride;
    for (int v = 0; v < DV; ++v) _mm256_storeu_ps(dst + j * DV * 8 + v * 8, load8(src + v * 8));
  }
}

// one key's 8 lane partials of q . k: lane l sums q[8c + l] k[8c + l] over the chunks c in order
template <int DV>
inline __m256 dot_chunks(const float* q, const float* k) {
  __m256 a = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(k));
  for (int c = 1; c < DV; ++c) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + c * 8), _mm256_loadu_ps(k + c * 8), a);
  return a;
}

// H pairs' value sums over keys [j0, j1), columns [8 c0, 8 (c0 + CW)) (kv: those keys' values), in
// key order, from and back to each pair's running sums in acc (zero at the first block); the keys
// every pair reads together, H pairs per value load, then each pair's own last keys
template <int D, int CW, int H, typename VT>
void values_block(const AttnPair* pairs, const float* scores, int64_t stride, const ValueRows<VT>& kv, int c0,
                  int64_t j0, int64_t j1, float* acc) {
  __m256 o[H * CW];
  int64_t common = j1;
  for (int h = 0; h < H; ++h) {
    common = std::min(common, pairs[h].len);
    for (int c = 0; c < CW; ++c)
      o[h * CW + c] = j0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(acc + h * D + (c0 + c) * 8);
  }
  for (int64_t jj = j0; jj < common; ++jj) {
    const VT* vj = kv.row(jj - j0, jj) + c0 * 8;
    __m256 v[CW];
    for (int c = 0; c < CW; ++c) v[c] = load8(vj + c * 8);
    for (int h = 0; h < H; ++h) {
      const __m256 pj = _mm256_broadcast_ss(scores + h * stride + jj);
      for (int c = 0; c < CW; ++c) o[h * CW + c] = _mm256_fmadd_ps(pj, v[c], o[h * CW + c]);
    }
  }
  for (int h = 0; h < H; ++h) {
    const int64_t end = std::min(j1, pairs[h].len);
    for (int64_t jj = std::max(j0, common); jj < end; ++jj) {
      const __m256 pj = _mm256_broadcast_ss(scores + h * stride + jj);
      const VT* vj = kv.row(jj - j0, jj) + c0 * 8;
      for (int c = 0; c < CW; ++c) o[h * CW + c] = _mm256_fmadd_ps(pj, load8(vj + c * 8), o[h * CW + c]);
    }
    for (int c = 0; c < CW; ++c) _mm256_storeu_ps(acc + h * D + (c0 + c) * 8, o[h * CW + c]);
  }
}

template <int D, int CW, int HB, typename VT>
void values_any(int h, const AttnPair* pairs, const float* scores, int64_t stride, const ValueRows<VT>& kv, int c0,
                int64_t j0, int64_t j1, float* acc) {
  if constexpr (HB > 1) {
    if (h < HB) return values_any<D, CW, HB - 1, VT>(h, pairs, scores, stride, kv, c0, j0, j1, acc);
  }
  values_block<D, CW, HB, VT>(pairs, scores, stride, kv, c0, j0, j1, acc);
}

// every pair's value sums over keys [j0, j1): column chunks of CW vectors, HB pairs per value load
template <int DV, typename VT>
void values_pass(int P, const AttnPair* pairs, const float* scores, int64_t stride, const ValueRows<VT>& kv,
                 int64_t j0, int64_t j1, float* acc) {
  constexpr int D = DV * 8, CW = DV < 8 ? DV : 8, HB = DV >= 8 ? 1 : 8 / DV;
  for (int c0 = 0; c0 < DV; c0 += CW)
    for (int p0 = 0; p0 < P; p0 += HB)
      values_any<D, CW, HB, VT>(std::min(HB, P - p0), pairs + p0, scores + p0 * stride, stride, kv, c0, j0, j1,
                                acc + p0 * D);
}

// one tile (common.h): every pair p's out = softmax(scale q_p . K^T) V over its first len_p keys.
// Per pair, as a tile of one pair would: scores 8 keys at a time (a product chain over the head's
// 8-lane chunks, then sum8), their lane-wise maximum block by block, e^(s - max) and its sum in key
// order, then the values summed in key order and one division. DV = D / 8.
template <typename T, int DV>
void attend_tile(const AttnPair* pairs, int P, int64_t max_len, const T* kc, const T* vc, const int64_t* slots,
                 int64_t slot_stride, float scale, float* scores, int64_t stride, float* kv, float* acc_buf,
                 float* mx_buf) {
  constexpr int D = DV * 8, HB = DV >= 8 ? 1 : 8 / DV;
  constexpr int VB = D >= 256 ? 16 : 4096 / D;            // values per block: 16 KB of fp32
  const __m256 scale_v = _mm256_set1_ps(scale);
  for (int p = 0; p < P; ++p) _mm256_storeu_ps(mx_buf + p * 8, _mm256_set1_ps(-INFINITY));
  prefetch_rows(kc, slots, 0, std::min(max_len, ATTN_PREFETCH_KEYS), slot_stride, D);
  for (int64_t j0 = 0; j0 < max_len; j0 += 8) {
    // the keys ATTN_PREFETCH_KEYS ahead, and this block's values (summed after the scores)
    prefetch_rows(kc, slots, std::min(max_len, j0 + ATTN_PREFETCH_KEYS), std::min(max_len, j0 + ATTN_PREFETCH_KEYS + 8),
                  slot_stride, D);
    prefetch_rows(vc, slots, j0, std::min(max_len, j0 + 8), slot_stride, D);
    widen_rows<T, DV>(kc, slots + j0, static_cast<int>(std::min<int64_t>(8, max_len - j0)), slot_stride, kv);
    for (int p = 0; p < P; ++p) {
      if (pairs[p].len <= j0) continue;
      const int n = static_cast<int>(std::min<int64_t>(8, pairs[p].len - j0));
      __m256 acc[8];
      if (n == 8) {
        for (int j = 0; j < 8; ++j) acc[j] = dot_chunks<DV>(pairs[p].q, kv + j * D);
      } else {
        for (int j = 0; j < 8; ++j) acc[j] = j < n ? dot_chunks<DV>(pairs[p].q, kv + j * D) : _mm256_setzero_ps();
      }
      const __m256 sc = _mm256_mul_ps(sum8(acc), scale_v);
      _mm256_storeu_ps(scores + p * stride + j0, sc);         // lanes past len land in the padding
      const __m256 mxv = _mm256_loadu_ps(mx_buf + p * 8);
      _mm256_storeu_ps(mx_buf + p * 8, _mm256_max_ps(mxv, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), sc, lanes_below(n))));
    }
  }
  for (int p = 0; p < P; ++p) {
    float* sg = scores + p * stride;
    const int64_t len = pairs[p].len;
    const __m256 mxv = _mm256_loadu_ps(mx_buf + p * 8);
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mxv), _mm256_extractf128_ps(mxv, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    const __m256 mx = _mm256_set1_ps(_mm_cvtss_f32(m4));
    __m256 sumv = _mm256_setzero_ps();
    for (int64_t j = 0; j < len; j += 8) {
      const __m256 e = _mm256_and_ps(exp256(_mm256_sub_ps(_mm256_loadu_ps(sg + j), mx)),
                                     lanes_below(static_cast<int>(std::min<int64_t>(8, len - j))));
      _mm256_storeu_ps(sg + j, e);
      sumv = _mm256_add_ps(sumv, e);
    }
    mx_buf[p] = 1.0f / hsum8(sumv);                      // the pair's 1 / sum (its maximum is spent)
  }
  if (P <= HB) {                                         // one pass of the pairs: each value row read once
    values_pass<DV, T>(P, pairs, scores, stride, ValueRows<T>{vc, slots, slot_stride}, 0, max_len, acc_buf);
  } else {
    for (int64_t j0 = 0; j0 < max_len; j0 += VB) {
      const int64_t j1 = std::min<int64_t>(max_len, j0 + VB);
      widen_rows<T, DV>(vc, slots + j0, static_cast<int>(j1 - j0), slot_stride, kv);
      values_pass<DV, float>(P, pairs, scores, stride, ValueRows<float>{kv, nullptr, D}, j0, j1, acc_buf);
    }
  }
  for (int p = 0; p < P; ++p) {
    const __m256 invv = _mm256_set1_ps(mx_buf[p]);
    for (int c = 0; c < DV; ++c)
      _mm256_storeu_ps(pairs[p].out + c * 8, _mm256_mul_ps(_mm256_loadu_ps(acc_buf + p * D + c * 8), invv));
  }
}

template <typename T>
void attend_tile_any(int D, const AttnPair* pairs, int P, int64_t max_len, const T* kc, const T* vc,
                     const int64_t* slots, int64_t slot_stride, float scale, float* scores, int64_t stride, float* kv,
                     float* acc_buf, float* mx_buf) {
  switch (D / 8) {
#define CASE(n) case n: attend_tile<T, n>(pairs, P, max_len, kc, vc, slots, slot_stride, scale, scores, stride, kv, \
                                          acc_buf, mx_buf); break;
    CASE(2) CASE(4) CASE(8) CASE(16) CASE(32)
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

// n fp32 values -> bf16, round to nearest even, 8 at a time (the same results as to_bf16)
inline void to_bf16_n(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
  const __m256i bias = _mm256_set1_epi32(0x7FFF), one = _mm256_set1_epi32(1);
  for (; i + 8 <= n; i += 8) {
    const __m256i u = _mm256_castps_si256(_mm256_loadu_ps(src + i));
    const __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(u, _mm256_add_epi32(bias, _mm256_and_si256(_mm256_srli_epi32(u, 16), one))), 16);
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), packed);
  }
  for (; i < n; ++i) dst[i] = to_bf16(src[i]);
}

// out[r] = bf16(w * (x[r] / rms(x[r])))
inline void rms_norm_row_bf16(const float* x, const float* w, int r, int H, float eps, uint16_t* out) {
  const float* xr = x + static_cast<int64_t>(r) * H;
  __m256 acc = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= H; i += 8) {
    const __m256 v = _mm256_loadu_ps(xr + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float ss = hsum8(acc);
  for (; i < H; ++i) ss += xr[i] * xr[i];
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(H) + eps);
  uint16_t* o = out + static_cast<int64_t>(r) * H;
  alignas(32) float tmp[8];
  int j = 0;
  for (; j + 8 <= H; j += 8) {
    _mm256_store_ps(tmp, _mm256_mul_ps(_mm256_loadu_ps(w + j), _mm256_mul_ps(_mm256_loadu_ps(xr + j), _mm256_set1_ps(inv))));
    to_bf16_n(tmp, o + j, 8);
  }
  for (; j < H; ++j) o[j] = to_bf16(w[j] * (xr[j] * inv));
}

// a gated MLP's activation, of 8 gate lanes and of one gate value (a row's tail)
struct SiluGate {                                 // silu(g) = g / (1 + exp(-g))
  static __m256 lanes(__m256 g) {
    return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), exp256(_mm256_sub_ps(_mm256_setzero_ps(), g))));
  }
  static float one(float g) { return g / (1.0f + std::exp(-g)); }
};

// gelu_tanh: 0.5 g (1 + tanh(t)) written as g / (1 + exp(-2 t)), t = sqrt(2 / pi) (g + 0.044715 g^3),
// so one exp serves (a -2 t past exp's range gives the limit, -0 or a tiny quotient)
struct GeluGate {
  static __m256 lanes(__m256 g) {
    const __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
    const __m256 t = _mm256_mul_ps(_mm256_set1_ps(GELU_K), _mm256_fmadd_ps(_mm256_set1_ps(GELU_C), g3, g));
    const __m256 e = exp256(_mm256_mul_ps(_mm256_set1_ps(-2.0f), t));
    return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
  }
  static float one(float g) { return gelu_tanh(g); }
};

// out = bf16(act(gate) * up) for one row of [gate | up] (I each), 8 lanes at a time
template <typename Act>
inline void gated_mul_row(const float* gu, int I, uint16_t* out) {
  const float* g = gu;
  const float* u = gu + I;
  alignas(32) float tmp[8];
  int i = 0;
  for (; i + 8 <= I; i += 8) {
    _mm256_store_ps(tmp, _mm256_mul_ps(Act::lanes(_mm256_loadu_ps(g + i)), _mm256_loadu_ps(u + i)));
    to_bf16_n(tmp, out + i, 8);
  }
  for (; i < I; ++i) out[i] = to_bf16(Act::one(g[i]) * u[i]);
}

inline void silu_mul_row(const float* gu, int I, uint16_t* out) { gated_mul_row<SiluGate>(gu, I, out); }
inline void gelu_mul_row(const float* gu, int I, uint16_t* out) { gated_mul_row<GeluGate>(gu, I, out); }


// index of the first maximum of x[0, n) (torch.argmax's rules: the first maximum; a NaN counts as
// the maximum, so the first NaN wins), 8 lanes at a time
inline int64_t argmax_row(const float* x, int64_t n) {
  int64_t i = 0, best_i = 0;
  float best = -INFINITY;
  bool nan = false;
  if (n >= 8) {
    __m256 vmax = _mm256_loadu_ps(x);
    __m256 unord = _mm256_cmp_ps(vmax, vmax, _CMP_UNORD_Q);
    __m256i vidx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256i cur = vidx;
    const __m256i step = _mm256_set1_epi32(8);
    for (i = 8; i + 8 <= n; i += 8) {
      cur = _mm256_add_epi32(cur, step);
      const __m256 v = _mm256_loadu_ps(x + i);
      unord = _mm256_or_ps(unord, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      const __m256 gt = _mm256_cmp_ps(v, vmax, _CMP_GT_OQ);          // strictly greater: first index kept
      vmax = _mm256_blendv_ps(vmax, v, gt);
      vidx = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(vidx), _mm256_castsi256_ps(cur), gt));
    }
    nan = _mm256_movemask_ps(unord) != 0;
    alignas(32) float mv[8];
    alignas(32) int32_t mi[8];
    _mm256_store_ps(mv, vmax);
    _mm256_store_si256(reinterpret_cast<__m256i*>(mi), vidx);
    best = mv[0];
    best_i = mi[0];
    for (int l = 1; l < 8; ++l)
      if (mv[l] > best || (mv[l] == best && mi[l] < best_i)) { best = mv[l]; best_i = mi[l]; }
  }
  for (; i < n && !nan; ++i)
    if (x[i] > best || std::isnan(x[i])) {
      nan = std::isnan(x[i]);
      best = x[i];
      best_i = i;
    }
  if (nan)
    for (int64_t j = 0; j < n; ++j)
      if (std::isnan(x[j])) return j;
  return best_i;
}

}  // namespace

bool amx_available() { return false; }

torch::Tensor affine_linear(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale,
                            const torch::Tensor& minimum, int64_t group, int64_t offset, int64_t high_bits) {
  return affine_linear_avx2(x, codes, scale, minimum, group, offset, high_bits);   // avx2_q8act.h
}

}  // namespace draftwise

#include "layer.h"
