// The kernels' interface: what one ISA's kernel translation units (avx512.cpp + layer.h, avx2.cpp +
// layer.h) define and its Python bindings (bindings.h, compiled apart so that the kernels never
// include the Python and libtorch headers, and the two compile in parallel) expose. ATen only.
#pragma once

#include "tensor.h"

#include <vector>

namespace draftwise {

// y [M, N] fp32 = x [M, K] bf16 . W^T, in the packed layouts of common.h / q8act.h
torch::Tensor int4_linear(const torch::Tensor& x, const torch::Tensor& nibbles, const torch::Tensor& sm, bool use_amx);
torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& q8, const torch::Tensor& scale, bool use_amx);
torch::Tensor affine_linear(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale,
                            const torch::Tensor& minimum, int64_t group, int64_t offset, int64_t high_bits);
// row-invariant attention: every row alone over its own keys
void attend_rows(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache, torch::Tensor& out,
                 const std::vector<int64_t>& rows, const std::vector<int64_t>& lens,
                 const std::vector<int64_t>& slot_lists, const std::vector<torch::Tensor>& slots, double scale);
bool amx_available();

// A layer linear in the kernels' forms: its row parts (one, or several where a fused projection
// mixes block kinds), each int4 (GGUF Q4_1 blocks: nibbles and their fp16 scale table) or
// group-affine (every GGUF family), their outputs joined, then an optional fp32 bias added (the
// eager path's order: the kernel's fp32 output, then + bias).
struct Linear {
  struct Part {
    bool int4;
    torch::Tensor codes, scale, minimum;
    int64_t group, offset, high_bits;
  };
  std::vector<Part> parts;
  torch::Tensor bias;                  // fp32 [N], or empty
  bool use_amx = false;

  torch::Tensor operator()(const torch::Tensor& x) const;   // layer.h
};

// the optional parts of a layer beyond Llama's: q/k norms (Qwen3, Gemma 3), a norm on the attention
// output and on the MLP output before their residual adds, GELU instead of SiLU (Gemma 3); an empty
// tensor is a part the layer does not have
struct LayerExtras {
  torch::Tensor q_norm, k_norm, post_attn_norm, post_ffn_norm;
  bool gelu = false;
};

torch::Tensor attn_in(const torch::Tensor& x, const torch::Tensor& norm_w, double eps, const Linear& qkv_proj,
                      const torch::Tensor& cos, const torch::Tensor& sin, int64_t nq, int64_t nkv, int64_t D,
                      const torch::Tensor& slots, torch::Tensor k_cache, torch::Tensor v_cache, const LayerExtras& ex);
torch::Tensor attn_out_mlp(const torch::Tensor& x, const torch::Tensor& attn, const Linear& o_proj,
                           const torch::Tensor& norm_w, double eps, const Linear& gate_up_proj,
                           const Linear& down_proj, const LayerExtras& ex);
torch::Tensor row_argmax(const torch::Tensor& logits);

// A row plan's kernel arguments (kernels/__init__.py:row_plan_args)
struct RowPlan {
  std::vector<int64_t> rows, lens, slot_lists;
  std::vector<torch::Tensor> slot_tensors;
};

struct FusedStack {
  std::vector<Linear> qkv, o, gate_up, down;
  std::vector<torch::Tensor> in_norm, post_norm, k_caches, v_caches;
  std::vector<LayerExtras> extras;
  std::vector<bool> local;              // sliding-window layers: their own RoPE rows and row plan
  double eps;
  int64_t nq, nkv, D;
  double scale;

  // x [T, H] fp32 -> (x after the last layer, then x before each layer in `capture`, in order);
  // cos / sin and `plan` serve the global layers, cos_local / sin_local and `local_plan` the
  // sliding-window ones
  std::vector<torch::Tensor> run(torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin,
                                 const torch::Tensor& cos_local, const torch::Tensor& sin_local,
                                 const torch::Tensor& slots, const RowPlan& plan, const RowPlan& local_plan,
                                 const std::vector<int64_t>& capture);   // layer.h
};

}  // namespace draftwise
