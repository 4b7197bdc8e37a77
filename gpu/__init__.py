"""Real backend: a Llama decoder in torch over a paged KV cache, with Triton kernels.

Importing this package is cheap (no torch): the CLI imports it at start-up.
"""
