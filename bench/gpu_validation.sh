#!/usr/bin/env bash
# The first thing to run on a machine with a GPU (docs/gpu.md): Triton kernels against their torch
# twins, decode-attention bandwidth against the GPU's peak and the static estimate, the kernels'
# compiled resources, a replay of Llama-3.1-8B-shaped random weights, a profile fitted to it and the
# simulator cross-checked against a held-out replay; every figure lands in OUT (summary.md first).
# Without CUDA it runs the same steps at tiny sizes on CPU (the test suite does, so it cannot rot).
# Needs only the installed kvsim, torch and triton: nothing is downloaded.
#
#   bench/gpu_validation.sh [OUT] [--tiny] [--gpu CATALOG_GPU]      (OUT default runs/gpu-validation)
set -euo pipefail
out="runs/gpu-validation"
if [[ $# -gt 0 && "$1" != -* ]]; then out="$1"; shift; fi     # OUT is optional: `--tiny` alone is an option
python="${PYTHON:-python}"
"$python" -c "import kvsim.gpu, torch, triton" || { echo "gpu_validation.sh: kvsim, torch and triton must be importable by $python" >&2; exit 2; }
exec "$python" -m kvsim.gpu.validate --out "$out" "$@"
