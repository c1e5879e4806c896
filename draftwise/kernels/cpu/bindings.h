// The Python module of one ISA's kernels (included by avx512_bind.cpp / avx2_bind.cpp, which name the
// ISA in KERNEL_ISA): pybind11 over the declarations of kernels.h, whose definitions are compiled in
// the ISA's kernel translation unit. Suffix decoding's helpers (suffix.h, numpy in and out) live here.
#pragma once

#include <torch/csrc/utils/pybind.h>   // the at::Tensor caster without the rest of torch/python.h (~7 s less to compile)

#include "kernels.h"
#include "stack.h"
#include "suffix.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace draftwise;
  m.def("int4_linear", &int4_linear, "weight-stationary int4 (group 32) linear, bf16 x, fp32 out");
  m.def("affine_linear", &affine_linear, "group-affine linear (every GGUF block family), bf16 x, fp32 out");
  m.def("int8_linear", &int8_linear, "weight-stationary int8 (per output channel) linear, bf16 x, fp32 out");
  m.def("attend_rows", &attend_rows, "row-invariant attention: every row alone over its own keys");
  m.def("attn_in", &attn_in, "RMSNorm -> qkv linear -> RoPE -> K/V into the cache, per row; returns q");
  m.def("row_argmax", &row_argmax, "argmax of every logits row (first maximum), rows in parallel");
  m.def("attn_out_mlp", &attn_out_mlp, "o_proj + residual -> RMSNorm -> gate/up -> SiLU*up -> down + residual");
  py::class_<Linear>(m, "Linear", py::module_local())
      .def(py::init([](std::vector<bool> int4, std::vector<torch::Tensor> codes, std::vector<torch::Tensor> scales,
                       std::vector<torch::Tensor> minimums, std::vector<int64_t> groups, std::vector<int64_t> offsets,
                       std::vector<int64_t> high_bits, torch::Tensor bias, bool use_amx) {
        Linear lin;
        for (size_t i = 0; i < codes.size(); ++i)
          lin.parts.push_back({int4[i], codes[i], scales[i], minimums[i], groups[i], offsets[i], high_bits[i]});
        lin.bias = bias;
        lin.use_amx = use_amx;
        return lin;
      }))
      .def("__call__", &Linear::operator(), "y [M, N] fp32 = x [M, K] bf16 . W^T (+ bias)");
  py::class_<LayerExtras>(m, "LayerExtras", py::module_local())
      .def(py::init([](torch::Tensor q_norm, torch::Tensor k_norm, torch::Tensor post_attn_norm,
                       torch::Tensor post_ffn_norm, bool gelu) {
        return LayerExtras{q_norm, k_norm, post_attn_norm, post_ffn_norm, gelu};
      }));
  py::class_<RowPlan>(m, "RowPlan", py::module_local())
      .def(py::init([](std::vector<int64_t> rows, std::vector<int64_t> lens, std::vector<int64_t> slot_lists,
                       std::vector<torch::Tensor> slot_tensors) {
        return RowPlan{rows, lens, slot_lists, slot_tensors};
      }));
  py::class_<FusedStack>(m, "FusedStack", py::module_local())   // one per ISA module in a process
      .def(py::init([](std::vector<Linear> qkv, std::vector<Linear> o, std::vector<Linear> gate_up,
                       std::vector<Linear> down, std::vector<torch::Tensor> in_norm,
                       std::vector<torch::Tensor> post_norm, std::vector<torch::Tensor> k_caches,
                       std::vector<torch::Tensor> v_caches, std::vector<LayerExtras> extras, std::vector<bool> local,
                       double eps, int64_t nq, int64_t nkv, int64_t D, double scale) {
        return FusedStack{qkv, o, gate_up, down, in_norm, post_norm, k_caches, v_caches, extras, local, eps, nq, nkv, D,
                          scale};
      }))
      .def("run", &FusedStack::run, py::call_guard<py::gil_scoped_release>(),
           "every layer of a row-by-row step: (x after the stack, x before each captured layer)");
  m.def("suffix_longest_match", &suffix_longest_match,
        "suffix decoding: the longest common suffix of the context among candidate positions, and those reaching it");
  m.def("suffix_chain", &suffix_chain, "suffix decoding: the chain of most frequent continuations of occurrences");
  m.def("suffix_array_narrow", &suffix_array_narrow,
        "suffix decoding: narrow a backward suffix array's rows to the context's longest suffix");
  m.def("amx_available", &amx_available);
  m.attr("isa") = KERNEL_ISA;
}
