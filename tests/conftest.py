import os

# Triton kernels run on CPU only in interpreter mode, which must be set before they are defined.
os.environ.setdefault("TRITON_INTERPRET", "1")
