// The whole layer stack of a row-by-row step in one call: a loop over the layer kernels that
// kernels.h declares (layer.h defines them in each ISA's unit). Compiled with the bindings
// (bindings.h), which include the profiler's header anyway: its labels name each kernel call in
// `draftwise bench step-cost`, and in the kernels' unit that header alone cost ~2.5 s of a first
// start's compile.
#pragma once

#include "kernels.h"

#include <ATen/record_function.h>

namespace draftwise {

// --- the whole layer stack of a decode / verification step in one call ------------------------------
// A step whose rows all attend row by row (decode, chain or tree verification) runs every layer as
// attn_in -> attend_rows -> attn_out_mlp; doing that loop here instead of in Python saves ~40 us of
// interpreter and dispatch per layer (over a millisecond per step of a 30-layer model, ~15 % of a
// plain decode step). The same calls in the same order: the numbers are those of the per-layer path.
std::vector<torch::Tensor> FusedStack::run(torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin,
                                           const torch::Tensor& cos_local, const torch::Tensor& sin_local,
                                           const torch::Tensor& slots, const RowPlan& plan, const RowPlan& local_plan,
                                           const std::vector<int64_t>& capture) {
  std::vector<torch::Tensor> out(1);
  const int64_t T = x.size(0);
  size_t c = 0;
  for (size_t l = 0; l < qkv.size(); ++l) {
    if (c < capture.size() && capture[c] == static_cast<int64_t>(l)) { out.push_back(x); ++c; }
    torch::Tensor q, a;
    {
      RECORD_FUNCTION("draftwise::attn_in", std::vector<c10::IValue>());
      q = attn_in(x, in_norm[l], eps, qkv[l], local[l] ? cos_local : cos, local[l] ? sin_local : sin, nq, nkv, D,
                  slots, k_caches[l], v_caches[l], extras[l]);
    }
    {
      RECORD_FUNCTION("draftwise::attend_rows", std::vector<c10::IValue>());
      a = new_empty({T, nq, D}, x.options());
      const RowPlan& p = local[l] ? local_plan : plan;
      attend_rows(q.view({T, nq, D}), k_caches[l], v_caches[l], a, p.rows, p.lens, p.slot_lists, p.slot_tensors,
                  scale);
    }
    RECORD_FUNCTION("draftwise::attn_out_mlp", std::vector<c10::IValue>());
    x = attn_out_mlp(x, a.view({T, nq * D}), o[l], post_norm[l], eps, gate_up[l], down[l], extras[l]);
  }
  out[0] = x;
  return out;
}

}  // namespace draftwise
