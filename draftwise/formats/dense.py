"""Plain-number GGUF types (norm weights, biases, small tables; whole models in F16 / BF16):
read as fp32 exactly."""
from __future__ import annotations

import numpy as np
import torch

DENSE = {"F32": np.float32, "F16": np.float16, "BF16": None}


def read_dense(type_name: str, raw: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
    """Raw bytes of an F32 / F16 / BF16 tensor -> fp32 [shape] (exact)."""
    raw = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if type_name == "BF16":
        t = torch.from_numpy(raw.view(np.int16).copy()).view(torch.bfloat16).float()
    elif type_name in DENSE:
        t = torch.from_numpy(raw.view(DENSE[type_name]).astype(np.float32))
    else:
        raise ValueError(f"{type_name} is not a dense type")
    return t.reshape(shape)
