// The tensor type every kernel file and the bindings share, and CPU allocation, from the lightest
// ATen headers that have them: not ATen/ATen.h, nor even ATen/ops/empty.h (operator declarations:
// ~3 s more to compile each translation unit of a first start).
#pragma once

#include <ATen/EmptyTensor.h>
#include <ATen/core/Tensor.h>

// torch::Tensor, torch::kFloat, ... as torch/types.h spells them, without the Python and libtorch
// headers: the kernels' translation units include ATen alone, the bindings (bindings.h) the rest
namespace torch { using namespace at; }

namespace draftwise {

// at::empty for the CPU tensors the kernels return, straight from the CPU allocator
inline torch::Tensor new_empty(at::IntArrayRef size, const at::TensorOptions& options) {
  return torch::Tensor(at::detail::empty_cpu(size, options));
}

}  // namespace draftwise
