"""LeanKV precision groups: bits per K and V element and bytes per token (no torch, so the simulator's
page accounting can import them cheaply; gpu.quant quantizes with them)."""
from __future__ import annotations

from dataclasses import dataclass

META_BYTES = 8  # fp16 scale + zero for K and for V


@dataclass(frozen=True)
class PrecisionFormat:
    name: str
    key_bits: int
    value_bits: int

    def __post_init__(self) -> None:
        for bits in (self.key_bits, self.value_bits):
            if bits not in (2, 4, 8):
                raise ValueError(f"precision group {self.name}: bits must be 2, 4 or 8, got {bits}")

    def bytes_per_token(self, head_dim: int) -> int:
        return head_dim * (self.key_bits + self.value_bits) // 8 + META_BYTES

    def tokens_per_page(self, page_bytes: int, head_dim: int) -> int:
        return page_bytes // self.bytes_per_token(head_dim)


PRECISION_FORMATS = {"K8V4": PrecisionFormat("K8V4", 8, 4), "K4V2": PrecisionFormat("K4V2", 4, 2), "K8V8": PrecisionFormat("K8V8", 8, 8)}
