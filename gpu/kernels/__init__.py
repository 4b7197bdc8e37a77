"""Triton kernels with plain-torch twins. `backend=None` picks Triton for CUDA tensors and the
torch twin otherwise; `backend="triton"` forces Triton (on CPU it needs TRITON_INTERPRET=1)."""
from __future__ import annotations

import torch

BACKENDS = (None, "torch", "triton")


def use_triton(tensor: torch.Tensor, backend: str | None) -> bool:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend == "triton" or (backend is None and tensor.is_cuda)
