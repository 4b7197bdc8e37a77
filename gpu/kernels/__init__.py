"""Triton kernels with plain-torch twins. `backend=None` picks Triton for CUDA tensors and the
torch twin otherwise; `backend="triton"` forces Triton (on CPU it needs TRITON_INTERPRET=1)."""
from __future__ import annotations

import os

import torch

# Triton kernels run on CPU only in interpreter mode, which must be set before they are defined.
# On a CUDA machine leave it unset so the kernels are compiled (tests set it explicitly).
if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

BACKENDS = (None, "torch", "triton")


def use_triton(tensor: torch.Tensor, backend: str | None) -> bool:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend == "triton" or (backend is None and tensor.is_cuda)
