"""Inference-time linear layers.

On CPU, `x @ W^T` with W stored row-major ([out, in], as checkpoints store it) goes through a
slower GEMM path for the skinny matrices of decoding and verification than `x @ Wt` with the
transpose stored contiguously ([in, out]). Measured here for a SmolLM2-shaped weight stack (one
thread): 1 token 52 -> 42 ms, 4 tokens 99 -> 61 ms. `prepare_linears_for_inference` swaps every
nn.Linear of a loaded model for this layout; the math is the same matrix product."""
from __future__ import annotations

import torch
from torch import nn


class TransposedLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight_t", linear.weight.detach().t().contiguous())
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    @property
    def weight(self) -> torch.Tensor:          # [out, in] view, for code that reads weights
        return self.weight_t.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = x.reshape(-1, shape[-1]) @ self.weight_t
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


def prepare_linears_for_inference(module: nn.Module) -> nn.Module:
    """Replace nn.Linear children (recursively) by TransposedLinear. CPU only: on CUDA the
    row-major layout is what cuBLAS wants."""
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, TransposedLinear(child))
        else:
            prepare_linears_for_inference(child)
    return module

