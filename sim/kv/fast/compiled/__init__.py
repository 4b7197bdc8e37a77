"""Fast mode's compiled (numba) kernels, their numpy twins, the array layout they share and their thread budget."""
