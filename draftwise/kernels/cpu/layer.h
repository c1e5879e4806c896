// A decoder layer's elementwise work fused around its linears (any kernel form: `Linear`) - the same
// for every ISA. The Python module that exposes it is compiled apart (bindings.h), against the
// declarations in kernels.h, and so is the loop over a step's layers (stack.h).
//
// One call does what ~25 eager PyTorch ops per layer did (RMSNorm, the bf16 cast, RoPE, SiLU-and-mul,
// the residual adds). Every row is computed alone, in a fixed order, so a row's values do not depend
// on the other rows of the call (speculation stays bit-exact with plain decoding).
//
// Included at the end of an ISA's translation unit (avx512.cpp, avx2.cpp), which defines first, in
// namespace draftwise:
//   torch::Tensor int4_linear(x, nibbles, sm, use_amx);      y [M, N] fp32 = x [M, K] bf16 . W^T
//   torch::Tensor int8_linear(x, q8, scale, use_amx);
//   torch::Tensor affine_linear(x, codes, scale, minimum, group, offset, high_bits);
//   void attend_rows(q, k_cache, v_cache, out, rows, lens, slot_lists, slots, scale);
//   void to_bf16_n(const float*, uint16_t*, int64_t);        round to nearest even
//   void rms_norm_row_bf16(x, w, r, H, eps, out);            out[r] = bf16(w * x[r] / rms(x[r]))
//   void silu_mul_row(gu, I, out);                           out = bf16(silu(gate) * up)
//   void gelu_mul_row(gu, I, out);                           out = bf16(gelu_tanh(gate) * up)
//   int64_t argmax_row(const float*, int64_t);               torch.argmax's rule (first max, NaN first)
//   bool amx_available();  and the macro KERNEL_ISA (the ISA's name)
#pragma once

#include "kernels.h"

namespace draftwise {

// the parts' outputs [M, N_i] fp32 side by side, [M, sum N_i] (join_columns(ys), without its header)
inline torch::Tensor join_columns(const std::vector<torch::Tensor>& ys) {
  const int64_t M = ys[0].size(0);
  std::vector<const float*> src;
  std::vector<int64_t> widths;
  int64_t N = 0;
  for (const torch::Tensor& t : ys) {
    TORCH_CHECK(t.scalar_type() == torch::kFloat && t.is_contiguous() && t.size(0) == M, "parts: fp32 [M, N_i]");
    src.push_back(t.data_ptr<float>());
    widths.push_back(t.size(1));
    N += t.size(1);
  }
  auto y = new_empty({M, N}, ys[0].options());
  float* yp = y.data_ptr<float>();
  for_rows(M, [&](int64_t r) {
    float* dst = yp + r * N;
    for (size_t i = 0; i < src.size(); ++i) {
      std::memcpy(dst, src[i] + r * widths[i], widths[i] * sizeof(float));
      dst += widths[i];
    }
  });
  return y;
}

torch::Tensor Linear::operator()(const torch::Tensor& x) const {
  std::vector<torch::Tensor> ys;
  for (const Part& p : parts)
    ys.push_back(p.int4 ? int4_linear(x, p.codes, p.scale, use_amx)
                        : affine_linear(x, p.codes, p.scale, p.minimum, p.group, p.offset, p.high_bits));
  torch::Tensor y = ys.size() == 1 ? ys[0] : join_columns(ys);
  if (bias.numel()) {
    const int64_t M = y.size(0), N = y.size(1);
    TORCH_CHECK(bias.numel() == N && bias.scalar_type() == torch::kFloat && bias.is_contiguous(), "bias: fp32 [N]");
    float* yp = y.data_ptr<float>();
    const float* bp = bias.data_ptr<float>();
    for_rows(M, [&](int64_t r) {
      for (int64_t i = 0; i < N; ++i) yp[r * N + i] = yp[r * N + i] + bp[i];
    });
  }
  return y;
}

inline void rms_norm_rows_bf16(const float* x, const float* w, int M, int H, float eps, uint16_t* out) {
  for_rows(M, [&](int64_t r) { rms_norm_row_bf16(x, w, static_cast<int>(r), H, eps, out); });
}

// RMSNorm of n fp32 values in place, in fp32 (q/k norms per head, Gemma's post-norms): x / rms(x) * w
inline void rms_norm_fp32(float* x, const float* w, int n, float eps) {
  float ss = 0.0f;
  for (int i = 0; i < n; ++i) ss += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int i = 0; i < n; ++i) x[i] = w[i] * (x[i] * inv);
}

// neox-layout rotary embedding of `nh` heads of one row in place: x[i] * cos[i] + rot(x)[i] * sin[i]
inline void rope_row(float* x, int nh, int D, const float* cos, const float* sin) {
  const int half = D / 2;
  for (int h = 0; h < nh; ++h) {
    float* xh = x + h * D;
    for (int i = 0; i < half; ++i) {
      const float a = xh[i], b = xh[i + half];
      const float lo = a * cos[i], lo_r = -b * sin[i];
      const float hi = b * cos[i + half], hi_r = a * sin[i + half];
      xh[i] = lo + lo_r;
      xh[i + half] = hi + hi_r;
    }
  }
}

// K or V rows (fp32, [M, nkv*D]) into their cache slots, converted to the cache dtype (round to
// nearest even: what a tensor .to(dtype) copy gives)
inline void write_cache_rows(const float* src, int M, int64_t width, const int64_t* slots, torch::Tensor& cache) {
  const auto dt = cache.scalar_type();
  for_rows(M, [&](int64_t r) {
    const float* row = src + r * width;
    const int64_t off = slots[r] * width;
    if (dt == torch::kFloat) {
      std::memcpy(cache.data_ptr<float>() + off, row, sizeof(float) * width);
    } else if (dt == torch::kBFloat16) {
      to_bf16_n(row, reinterpret_cast<uint16_t*>(cache.data_ptr<at::BFloat16>()) + off, width);
    } else {
      at::Half* o = cache.data_ptr<at::Half>() + off;
      for (int64_t i = 0; i < width; ++i) o[i] = static_cast<at::Half>(row[i]);
    }
  });
}

// The attention block's input side: h = RMSNorm(x) -> bf16 -> q|k|v = the qkv linear -> RoPE on q and k,
// then k and v written to their cache slots. x [M, H] fp32; cos / sin [M, D] (the rows' positions);
// slots [M] int64; caches [S, nkv, D] (fp32 / bf16 / fp16). Returns q [M, nq*D] fp32.
torch::Tensor attn_in(const torch::Tensor& x, const torch::Tensor& norm_w, double eps, const Linear& qkv_proj,
                             const torch::Tensor& cos, const torch::Tensor& sin, int64_t nq, int64_t nkv, int64_t D,
                             const torch::Tensor& slots, torch::Tensor k_cache, torch::Tensor v_cache,
                             const LayerExtras& ex) {
  TORCH_CHECK(slots.scalar_type() == torch::kLong && slots.is_contiguous() && slots.size(0) == x.size(0),
              "slots: contiguous int64 [M]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.size(1) * k_cache.size(2) == nkv * D &&
              k_cache.scalar_type() == v_cache.scalar_type(), "caches: contiguous [S, nkv, D], one dtype");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: contiguous fp32 [M, H]");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == D, "cos / sin: contiguous [M, D]");
  const int M = x.size(0), H = x.size(1);
  auto h = new_empty({M, H}, x.options().dtype(torch::kBFloat16));
  rms_norm_rows_bf16(x.data_ptr<float>(), norm_w.data_ptr<float>(), M, H, static_cast<float>(eps),
                     reinterpret_cast<uint16_t*>(h.data_ptr<at::BFloat16>()));
  auto qkv = qkv_proj(h);                                          // [M, (nq + 2 nkv) D]
  const int64_t W = (nq + 2 * nkv) * D;
  TORCH_CHECK(qkv.size(1) == W, "qkv width");
  auto q = new_empty({M, nq * D}, x.options());
  std::vector<float> k(static_cast<size_t>(M) * nkv * D), v(static_cast<size_t>(M) * nkv * D);
  float* qp = q.data_ptr<float>();
  const float* qkvp = qkv.data_ptr<float>();
  for_rows(M, [&](int64_t r) {
    const float* row = qkvp + r * W;
    std::memcpy(qp + r * nq * D, row, sizeof(float) * nq * D);
    std::memcpy(k.data() + r * nkv * D, row + nq * D, sizeof(float) * nkv * D);
    std::memcpy(v.data() + r * nkv * D, row + (nq + nkv) * D, sizeof(float) * nkv * D);
    const float* c = cos.data_ptr<float>() + r * D;
    const float* s = sin.data_ptr<float>() + r * D;
    if (ex.q_norm.numel()) {                      // per head, before RoPE
      for (int64_t h = 0; h < nq; ++h) rms_norm_fp32(qp + r * nq * D + h * D, ex.q_norm.data_ptr<float>(), D, eps);
      for (int64_t h = 0; h < nkv; ++h) rms_norm_fp32(k.data() + (r * nkv + h) * D, ex.k_norm.data_ptr<float>(), D, eps);
    }
    rope_row(qp + r * nq * D, nq, D, c, s);
    rope_row(k.data() + r * nkv * D, nkv, D, c, s);
  });
  write_cache_rows(k.data(), M, nkv * D, slots.data_ptr<int64_t>(), k_cache);
  write_cache_rows(v.data(), M, nkv * D, slots.data_ptr<int64_t>(), v_cache);
  return q;
}

// The rest of the layer: x1 = x + o_proj(attn); h = RMSNorm(x1); x2 = x1 + down(silu(gate) * up)
// (Gemma 3: x1 = x + norm(o_proj(attn)), GELU, x2 = x1 + norm(down(...))).
torch::Tensor attn_out_mlp(const torch::Tensor& x, const torch::Tensor& attn, const Linear& o_proj,
                                  const torch::Tensor& norm_w, double eps, const Linear& gate_up_proj,
                                  const Linear& down_proj, const LayerExtras& ex) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: contiguous fp32 [M, H]");
  TORCH_CHECK((attn.scalar_type() == torch::kFloat || attn.scalar_type() == torch::kBFloat16) && attn.is_contiguous(),
              "attn: contiguous fp32 or bf16");
  const int M = x.size(0), H = x.size(1);
  // the attention output in bf16 (the o_proj input): converted here, or as the bf16 attention gave it
  auto a16 = attn.scalar_type() == torch::kBFloat16 ? attn : new_empty({M, attn.size(1)}, x.options().dtype(torch::kBFloat16));
  if (attn.scalar_type() == torch::kFloat) {
    const float* ap = attn.data_ptr<float>();
    uint16_t* o = reinterpret_cast<uint16_t*>(a16.data_ptr<at::BFloat16>());
    const int64_t w = attn.size(1);
    for_rows(M, [&](int64_t r) { to_bf16_n(ap + r * w, o + r * w, w); });
  }
  auto x1 = o_proj(a16);                                             // o_proj(attn), then + x
  float* x1p = x1.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  for_rows(M, [&](int64_t r) {
    if (ex.post_attn_norm.numel()) rms_norm_fp32(x1p + r * H, ex.post_attn_norm.data_ptr<float>(), H, feps);
    for (int64_t i = 0; i < H; ++i) x1p[r * H + i] = xp[r * H + i] + x1p[r * H + i];
  });
  auto h = new_empty({M, H}, x.options().dtype(torch::kBFloat16));
  rms_norm_rows_bf16(x1p, norm_w.data_ptr<float>(), M, H, static_cast<float>(eps),
                     reinterpret_cast<uint16_t*>(h.data_ptr<at::BFloat16>()));
  auto gu = gate_up_proj(h);                                         // [M, 2 I]
  const int I = gu.size(1) / 2;
  auto act = new_empty({M, I}, x.options().dtype(torch::kBFloat16));
  uint16_t* ap = reinterpret_cast<uint16_t*>(act.data_ptr<at::BFloat16>());
  const float* gup = gu.data_ptr<float>();
  for_rows(M, [&](int64_t r) {
    if (ex.gelu) gelu_mul_row(gup + r * 2 * I, I, ap + r * I);
    else silu_mul_row(gup + r * 2 * I, I, ap + r * I);
  });
  auto y = down_proj(act);
  float* yp = y.data_ptr<float>();
  for_rows(M, [&](int64_t r) {
    if (ex.post_ffn_norm.numel()) rms_norm_fp32(yp + r * H, ex.post_ffn_norm.data_ptr<float>(), H, feps);
    for (int64_t i = 0; i < H; ++i) yp[r * H + i] = x1p[r * H + i] + yp[r * H + i];
  });
  return y;
}

// logits [M, V] fp32 -> int64 [M]: each row's argmax (first index of the maximum, as torch.argmax),
// rows in parallel chunks
torch::Tensor row_argmax(const torch::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat && logits.is_contiguous(),
              "logits: contiguous fp32 [M, V]");
  const int64_t M = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V > 0 && V < (int64_t(1) << 31), "vocabulary size");
  auto out = new_empty({M}, logits.options().dtype(torch::kLong));
  const float* lp = logits.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  for_rows(M, [&](int64_t r) { op[r] = argmax_row(lp + r * V, V); });
  return out;
}

}  // namespace draftwise

