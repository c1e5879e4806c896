// What every ISA's kernels share: the packed layouts' constants, the row loop, scalar bf16 rounding.
//
// Packed int4 layout (made by draftwise/kernels/__init__.py from codes [N, K], scale and minimum):
//   nibbles: uint8 [N/16, K/2, 16], byte j of pair p = code[n0+j][2p] | code[n0+j][2p+1] << 4
//   sm:      fp16 [N/16, K/32, 2, 16]: the group's 16 scales, then its 16 minimums (GGUF Q4_1 stores
//            both in fp16: exact)
// Packed int8 layout (per output channel): q8 int8 [N/16, K/2, 16, 2] (pairs), scale fp32 [N].
#pragma once

#include "tensor.h"

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>


namespace draftwise {

constexpr int NB = 16;   // output columns per block
constexpr int GROUP = 32;
constexpr int PAIRS = GROUP / 2;
// software prefetch distance of the weight streams: 2 KB (~ DRAM latency x one core's bandwidth);
// measured on SmolLM2's LM head at one row: 6.3 ms with none, 4.2 at 512 B, 3.3 at 2 KB (1 thread)
constexpr int PREFETCH_BYTES = 2048;

// a weight stream's cache line asked for ahead of use, into L2 (T1), not L1: a kernel streaming
// from DRAM keeps dozens of lines in flight, more than L1's miss buffers hold, and a prefetch into
// L1 then stalls the loads behind it. Measured on Zen 4 (one row, weights 4x the L3): Q4_K / Q6_K
// linears of Qwen2.5-1.5B's shapes streamed 13-17 GB/s per core with T0, 21-28 with T1 (a plain sum
// streams ~28); at 2 threads 20-31 -> 30-44 GB/s
inline void prefetch_weights(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }

// cache rows of one KV head, keys [from, to) of a key list, asked for into L2 ahead of use. A
// tile's keys and values lie in scattered blocks of a pool far larger than the caches: read as
// they are needed, a decode step's attention waited on DRAM latency key by key (~5 GB/s per core).
template <typename T>
inline void prefetch_rows(const T* c, const int64_t* slots, int64_t from, int64_t to, int64_t slot_stride, int D) {
  const int64_t bytes = static_cast<int64_t>(D) * sizeof(T);
  for (int64_t j = from; j < to; ++j) {
    const char* row = reinterpret_cast<const char*>(c + slots[j] * slot_stride);
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(row + b, _MM_HINT_T1);
  }
}
constexpr int64_t ATTN_PREFETCH_KEYS = 64;   // how far ahead of the key being scored

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

// GELU, tanh approximation, in the sigmoid form the vector kernels use:
// 0.5 g (1 + tanh(t)) = g / (1 + exp(-2 t)), t = sqrt(2 / pi) (g + 0.044715 g^3)
constexpr float GELU_K = 0.7978845608028654f;     // sqrt(2 / pi)
constexpr float GELU_C = 0.044715f;

inline float gelu_tanh(float g) {
  const float t = GELU_K * (GELU_C * (g * g * g) + g);
  return g / (1.0f + std::exp(-2.0f * t));
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
  TORCH_CHECK(nibbles.dim() == 3 && nibbles.size(2) == NB && nibbles.scalar_type() == torch::kByte, "nibbles layout");
  TORCH_CHECK(nibbles.size(1) * 2 == x.size(1) && x.size(1) % GROUP == 0, "K mismatch");
  TORCH_CHECK(sm.scalar_type() == torch::kHalf && sm.is_contiguous(), "sm: contiguous fp16");
}

inline void check_int8(const torch::Tensor& x, const torch::Tensor& q8, const torch::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.is_contiguous(), "x: contiguous bf16 [M, K]");
  TORCH_CHECK(q8.dim() == 4 && q8.size(2) == NB && q8.size(3) == 2 && q8.scalar_type() == torch::kChar, "q8 layout");
  TORCH_CHECK(q8.size(1) * 2 == x.size(1) && x.size(1) % GROUP == 0, "K mismatch");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat && scale.numel() == q8.size(0) * NB, "scale: float [N]");
}

// --- the row-invariant attention's tiles (every ISA file) -------------------------------------------
// A tile is a unit of attention work: up to ATTN_TILE_ROWS consecutive rows of one request (one key
// list) and one KV head. Its query vectors ("pairs": each row's G query heads, each with its own
// number of keys) are scored against each block of keys, and summed over each block of values, with
// the block widened to fp32 once for all of them. Every pair's own arithmetic (the order of its
// products, sums and maxima) is what a tile of that row alone does, so a row's bits never depend on
// the tile it lands in: the tile size only trades memory traffic against parallelism.
struct AttnPair {
  const float* q;
  float* out;
  int64_t len;
};

struct AttnTile {
  int64_t first, rows;   // entries [first, first + rows) of the call's row lists
  int head;              // the KV head
};

constexpr int64_t ATTN_TILE_ROWS = 16;   // a prefill tile's key and value blocks are widened once for 16 rows

// the call's tiles: each key list's rows split evenly into k tiles of at most ATTN_TILE_ROWS rows,
// k raised (up to one row per tile) until the tiles of the list, one per KV head each, give every
// thread two, in a count the threads share evenly
inline std::vector<AttnTile> attention_tiles(const std::vector<int64_t>& slot_lists, int Hkv) {
  const int64_t n = static_cast<int64_t>(slot_lists.size());
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  std::vector<AttnTile> tiles;
  for (int64_t i = 0; i < n;) {
    int64_t j = i + 1;
    while (j < n && slot_lists[j] == slot_lists[i]) ++j;
    const int64_t rows = j - i;
    int64_t k = std::max((rows + ATTN_TILE_ROWS - 1) / ATTN_TILE_ROWS, (2 * threads + Hkv - 1) / Hkv);
    while (k < rows && (k * Hkv) % threads != 0) ++k;
    k = std::min(k, rows);
    for (int64_t t = 0, first = i; t < k; ++t) {
      const int64_t size = rows / k + (t < rows % k ? 1 : 0);
      for (int h = 0; h < Hkv; ++h) tiles.push_back({first, size, h});
      first += size;
    }
    i = j;
  }
  return tiles;
}

// where the value rows of a block are: widened to fp32 in a scratch block (row i of the block), or
// read from the cache as they are (key jj's slot) when a single pass of pairs reads each row once
template <typename VT>
struct ValueRows {
  const VT* base;
  const int64_t* slots;      // null: the scratch block
  int64_t row_stride;
  const VT* row(int64_t i, int64_t jj) const { return slots ? base + slots[jj] * row_stride : base + i * row_stride; }
};

// one thread's working memory for tiles of up to `pairs` pairs over up to `stride` keys (a multiple
// of 16): scores [pairs, stride], a block of K or V rows widened to fp32 (16 KB, or 16 rows of D),
// the pairs' running value sums [pairs, D] and their maxima / 1 / sums [pairs, 16]; uninitialised
// (every value is written before it is read)
struct AttnScratch {
  std::unique_ptr<float[]> scores, kv, acc, mx;
  AttnScratch(int64_t pairs, int64_t stride, int64_t D)
      : scores(new float[pairs * stride]), kv(new float[std::max<int64_t>(4096, 16 * D)]),
        acc(new float[pairs * D]), mx(new float[pairs * 16]) {}
};

// the tiles in the order threads take them: longest first (work: a tile's rows x its longest key
// count). Threads take the next tile from this queue as they finish one, so a causal prompt's long
// tiles at the end of the prompt spread over every thread and a thread slowed by its neighbours on
// the machine takes fewer tiles. Which thread runs a tile never changes its bits.
inline std::vector<int64_t> tiles_longest_first(const std::vector<AttnTile>& tiles, const std::vector<int64_t>& lens) {
  std::vector<std::pair<int64_t, int64_t>> order;               // (-work, tile)
  order.reserve(tiles.size());
  for (size_t w = 0; w < tiles.size(); ++w) {
    int64_t keys = 0;
    for (int64_t i = tiles[w].first; i < tiles[w].first + tiles[w].rows; ++i) keys = std::max(keys, lens[i]);
    order.push_back({-tiles[w].rows * keys, static_cast<int64_t>(w)});
  }
  std::sort(order.begin(), order.end());
  std::vector<int64_t> out;
  out.reserve(order.size());
  for (const auto& o : order) out.push_back(o.second);
  return out;
}

// the most rows any tile holds
inline int64_t max_tile_rows(const std::vector<AttnTile>& tiles) {
  int64_t r = 1;
  for (const auto& t : tiles) r = std::max(r, t.rows);
  return r;
}

// the pairs of one tile (row-major: a row's G heads side by side); the longest key count
inline int64_t attention_pairs(const AttnTile& tile, const std::vector<int64_t>& rows, const std::vector<int64_t>& lens,
                               const float* q, float* out, int H, int G, int D, std::vector<AttnPair>& pairs) {
  pairs.clear();
  int64_t max_len = 0;
  for (int64_t i = tile.first; i < tile.first + tile.rows; ++i) {
    const int64_t base = (rows[i] * H + static_cast<int64_t>(tile.head) * G) * D;
    for (int g = 0; g < G; ++g) pairs.push_back({q + base + g * D, out + base + g * D, lens[i]});
    max_len = std::max(max_len, lens[i]);
  }
  return max_len;
}

// The attention of the listed rows, the same for every ISA: the tiles of the call (above) in
// parallel, each scored and summed by the ISA's `tile_fn(TypeTag<T>, D, pairs, P, max_len, kc, vc,
// slots, slot_stride, scale, scores, stride, kv, acc, mx)` over cache element type T.
// q [T, H, D] fp32; caches [S, Hkv, D] fp32, bf16 or fp16 (any slot and head strides, each row
// contiguous; widened to fp32, exact); out [T, H, D]
// written for the listed rows. rows[i]: the row; lens[i]: its number of keys; slot_lists[i]: index
// into `slots` of its request's key slots (the first lens[i] of them are its keys).
template <typename T>
struct TypeTag {
  using type = T;
};

template <typename T, typename F>
void attend_rows_typed(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                       torch::Tensor& out, const std::vector<int64_t>& rows, const std::vector<int64_t>& lens,
                       const std::vector<int64_t>& slot_lists, const std::vector<torch::Tensor>& slots, double scale,
                       const F& tile_fn) {
  const int H = q.size(1), D = q.size(2), Hkv = k_cache.size(1), G = H / Hkv;
  TORCH_CHECK((D == 16 || D == 32 || D == 64 || D == 128 || D == 256) && G <= 64 && k_cache.stride(2) == 1 &&
              v_cache.strides() == k_cache.strides(), "layout");
  const int64_t slot_stride = k_cache.stride(0), head_stride = k_cache.stride(1);
  const float* qp = q.data_ptr<float>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  float* op = out.data_ptr<float>();
  std::vector<const int64_t*> sp(slots.size());
  for (size_t i = 0; i < slots.size(); ++i) sp[i] = slots[i].data_ptr<int64_t>();
  int64_t max_len = 0;
  for (auto l : lens) max_len = std::max(max_len, l);
  const int64_t stride = (max_len + 15) / 16 * 16;
  const std::vector<AttnTile> tiles = attention_tiles(slot_lists, Hkv);
  const int64_t max_rows = max_tile_rows(tiles);
  const std::vector<int64_t> queue = tiles_longest_first(tiles, lens);
  const int64_t n = static_cast<int64_t>(queue.size());
  std::atomic<int64_t> next_tile{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), n), 1, [&](int64_t, int64_t) {
    AttnScratch scratch(max_rows * G, stride, D);
    std::vector<AttnPair> pairs;
    for (int64_t i = next_tile.fetch_add(1); i < n; i = next_tile.fetch_add(1)) {
      const AttnTile& tile = tiles[queue[i]];
      const int64_t peek = next_tile.load(std::memory_order_relaxed);
      if (peek < n) {                        // the queue's next tile's first keys, while this one runs
        const AttnTile& next = tiles[queue[peek]];
        prefetch_rows(kp + next.head * head_stride, sp[slot_lists[next.first]], 0,
                      std::min(lens[next.first], ATTN_PREFETCH_KEYS), slot_stride, D);
      }
      const int64_t len = attention_pairs(tile, rows, lens, qp, op, H, G, D, pairs);
      tile_fn(TypeTag<T>{}, D, pairs.data(), static_cast<int>(pairs.size()), len, kp + tile.head * head_stride,
              vp + tile.head * head_stride, sp[slot_lists[tile.first]], slot_stride, static_cast<float>(scale),
              scratch.scores.get(), stride, scratch.kv.get(), scratch.acc.get(), scratch.mx.get());
    }
  });
}

// the cache's element type chosen at run time
template <typename F>
void attend_rows_any(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                     torch::Tensor& out, const std::vector<int64_t>& rows, const std::vector<int64_t>& lens,
                     const std::vector<int64_t>& slot_lists, const std::vector<torch::Tensor>& slots, double scale,
                     const F& tile_fn) {
  const auto dt = k_cache.scalar_type();
  TORCH_CHECK(q.scalar_type() == torch::kFloat && out.scalar_type() == torch::kFloat && v_cache.scalar_type() == dt &&
              q.is_contiguous() && out.is_contiguous(), "fp32 contiguous q and out, one cache dtype");
  if (dt == torch::kFloat)
    attend_rows_typed<float>(q, k_cache, v_cache, out, rows, lens, slot_lists, slots, scale, tile_fn);
  else if (dt == torch::kBFloat16)
    attend_rows_typed<at::BFloat16>(q, k_cache, v_cache, out, rows, lens, slot_lists, slots, scale, tile_fn);
  else if (dt == torch::kHalf)
    attend_rows_typed<at::Half>(q, k_cache, v_cache, out, rows, lens, slot_lists, slots, scale, tile_fn);
  else
    TORCH_CHECK(false, "attend_rows: cache dtype must be fp32, bf16 or fp16");
}

}  // namespace draftwise
