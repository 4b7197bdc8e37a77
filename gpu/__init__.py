"""Real backend: a Llama decoder in torch over a paged KV cache, with Triton kernels."""
import os

# Triton kernels run on CPU only in interpreter mode, which must be set before they are defined.
# On a CUDA machine leave it unset so the kernels are compiled (tests set it explicitly).
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
