"""Mixed-precision KV pages (LeanKV precision groups), per-head layout.

A page is `page_bytes` bytes holding tokens of one (layer, KV head) at one precision group. A precision group
stores K with `key_bits` and V with `value_bits` per element (asymmetric min/max quantization per
token) plus fp16 scale and zero point for K and for V (8 bytes), so
tokens per page = page_bytes // (head_dim * (key_bits + value_bits) / 8 + 8).
Page byte layout for capacity C: [K codes C*kb | V codes C*vb | K scale | K zero | V scale | V zero]
(codes packed little-end first within each byte; scales and zeros fp16, C each).
Slot id = page_id * max_tokens_per_page + offset; which pages hold which precision group and which slots a
token goes to are decided by the engine core (its LeanKV policy), not here.
"""
from __future__ import annotations

import torch

from kvsim.gpu.kernels import use_triton
from kvsim.gpu.kernels.quant_attention import mixed_decode_attention
from kvsim.sim.kv.precision import META_BYTES, PRECISION_FORMATS, PrecisionFormat  # noqa: F401  (re-exported)


def quantize(x: torch.Tensor, bits: int):
    """Per-row asymmetric quantization: x [N, D] -> (codes uint8 [N, D], scale fp16 [N], zero fp16 [N])."""
    x = x.float()
    lo, hi = x.min(-1).values, x.max(-1).values
    zero = lo.half()
    scale = ((hi - zero.float()) / (2 ** bits - 1)).clamp(min=1e-8).half()
    codes = ((x - zero.float()[:, None]) / scale.float()[:, None]).round().clamp(0, 2 ** bits - 1)
    return codes.to(torch.uint8), scale, zero


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return codes.float() * scale.float()[..., None] + zero.float()[..., None]


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [N, D] (values < 2**bits) -> bytes [N, D * bits / 8]."""
    per_byte = 8 // bits
    grouped = codes.view(codes.shape[0], -1, per_byte).to(torch.int32)
    shifts = torch.arange(per_byte, device=codes.device, dtype=torch.int32) * bits
    return (grouped << shifts).sum(-1).to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    per_byte = 8 // bits
    shifts = torch.arange(per_byte, device=packed.device, dtype=torch.int32) * bits
    codes = (packed.to(torch.int32)[..., None] >> shifts) & (2 ** bits - 1)
    return codes.flatten(-2).to(torch.uint8)


class MixedPrecisionKVCache:
    def __init__(self, num_pages: int, page_bytes: int, head_dim: int, precisions: tuple[str, ...] = ("K8V4", "K4V2"),
                 device: str | torch.device = "cpu"):
        unknown = [t for t in precisions if t not in PRECISION_FORMATS]
        if unknown:
            raise ValueError(f"unknown precision format(s) {unknown}; known: {sorted(PRECISION_FORMATS)}")
        if head_dim * 2 % 8:
            raise ValueError(f"head_dim must be a multiple of 4 to pack 2-bit codes, got {head_dim}")
        self.precisions = [PRECISION_FORMATS[t] for t in precisions]
        self.num_pages, self.page_bytes, self.head_dim = num_pages, page_bytes, head_dim
        self.capacity = [t.tokens_per_page(page_bytes, head_dim) for t in self.precisions]
        if min(self.capacity) < 1:
            raise ValueError(f"page_bytes={page_bytes} holds no token of precision group "
                             f"{self.precisions[self.capacity.index(min(self.capacity))].name} at head_dim {head_dim}")
        self.max_tokens = max(self.capacity)
        self.device = torch.device(device)
        self.pages = torch.zeros(num_pages, page_bytes, dtype=torch.uint8, device=self.device)
        self.page_precision = torch.full((num_pages,), -1, dtype=torch.int8, device=self.device)
        self.live = torch.zeros(num_pages, self.max_tokens, dtype=torch.bool, device=self.device)

    def precision_index(self, name: str) -> int:
        return [t.name for t in self.precisions].index(name)

    def assign(self, page_ids: torch.Tensor, precision: str) -> None:
        """Give pages a precision group (the engine core's page allocator decides which); clears their slots."""
        page_ids = torch.as_tensor(page_ids, dtype=torch.long, device=self.device)
        self.page_precision[page_ids] = self.precision_index(precision)
        self.live[page_ids] = False

    def _regions(self, precision_idx: int):
        precision, cap, D = self.precisions[precision_idx], self.capacity[precision_idx], self.head_dim
        kb, vb = D * precision.key_bits // 8, D * precision.value_bits // 8
        k_end, v_end = cap * kb, cap * (kb + vb)
        meta = [v_end + i * 2 * cap for i in range(4)]   # k_scale, k_zero, v_scale, v_zero
        return precision, cap, kb, vb, k_end, meta

    def _split(self, slots: torch.Tensor, precisions: torch.Tensor | None = None):
        """(pages, offsets, precision group indices) of slots; `precision groups` overrides the pages' precision groups (a precision group move
        reads or writes at a precision group the page table has not been told yet)."""
        slots = torch.as_tensor(slots, dtype=torch.long, device=self.device).reshape(-1)
        pages, offsets = slots // self.max_tokens, slots % self.max_tokens
        if precisions is None:
            precisions = self.page_precision[pages].long()
        else:
            precisions = torch.as_tensor(precisions, dtype=torch.long, device=self.device).reshape(-1)
        if (precisions < 0).any():
            raise ValueError(f"slots {slots[precisions < 0].tolist()[:5]} are on pages with no precision group assigned")
        return pages, offsets, precisions

    def write(self, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              precisions: torch.Tensor | None = None) -> None:
        """Quantize key/value [N, head_dim] into their slots at their page's precision group (or `precision groups`, precision group
        indices per slot); marks slots live."""
        pages, offsets, precisions = self._split(slots, precisions)
        for t in precisions.unique().tolist():
            sel = precisions == t
            precision, cap, kb, vb, k_end, meta = self._regions(t)
            if (offsets[sel] >= cap).any():
                raise ValueError(f"offset beyond the {cap} tokens a {precision.name} page holds")
            p, o = pages[sel], offsets[sel]
            for x, bits, width, base, (s_at, z_at) in ((key[sel], precision.key_bits, kb, 0, meta[:2]),
                                                      (value[sel], precision.value_bits, vb, k_end, meta[2:])):
                codes, scale, zero = quantize(x, bits)
                cols = base + o[:, None] * width + torch.arange(width, device=self.device)
                self.pages[p[:, None], cols] = pack(codes, bits)
                for at, values in ((s_at, scale), (z_at, zero)):
                    cols = at + o[:, None] * 2 + torch.arange(2, device=self.device)
                    self.pages[p[:, None], cols] = values.view(torch.uint8).view(-1, 2)
        self.live.view(-1)[pages * self.max_tokens + offsets] = True

    def read(self, slots: torch.Tensor, precisions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K, V [N, head_dim] fp32 of the given slots (at their page's precision group, or `precision groups`)."""
        pages, offsets, precisions = self._split(slots, precisions)
        keys = torch.zeros(len(pages), self.head_dim, device=self.device)
        values = torch.zeros_like(keys)
        for t in precisions.unique().tolist():
            sel = precisions == t
            precision, cap, kb, vb, k_end, meta = self._regions(t)
            p, o = pages[sel], offsets[sel]
            for out, bits, width, base, (s_at, z_at) in ((keys, precision.key_bits, kb, 0, meta[:2]),
                                                        (values, precision.value_bits, vb, k_end, meta[2:])):
                packed = self.pages[p[:, None], base + o[:, None] * width + torch.arange(width, device=self.device)]
                scale, zero = (self.pages[p[:, None], at + o[:, None] * 2 + torch.arange(2, device=self.device)]
                               .contiguous().view(torch.float16).view(-1) for at in (s_at, z_at))
                out[sel] = dequantize(unpack(packed, bits), scale, zero)
        return keys, values

    def _token_columns(self, precision_idx: int, offsets: torch.Tensor) -> torch.Tensor:
        """[N, bytes per token] byte columns of the tokens at `offsets` of pages of one precision group."""
        precision, cap, kb, vb, k_end, meta = self._regions(precision_idx)
        o = offsets[:, None]
        ar = lambda n: torch.arange(n, device=self.device)   # noqa: E731
        parts = [o * kb + ar(kb), k_end + o * vb + ar(vb)] + [at + o * 2 + ar(2) for at in meta]
        return torch.cat(parts, dim=1)

    def move(self, src: torch.Tensor, dst: torch.Tensor, src_precisions: torch.Tensor, dst_precisions: torch.Tensor) -> None:
        """Move tokens between slots (all sources read before any destination is written); a token
        keeping its precision group is copied byte for byte, one changing precision group (a LeanKV demotion) is dequantized
        and re-quantized at the new precision group. Destinations take the sources' liveness; sources go empty."""
        src = torch.as_tensor(src, dtype=torch.long, device=self.device).reshape(-1)
        dst = torch.as_tensor(dst, dtype=torch.long, device=self.device).reshape(-1)
        if src.numel() == 0:
            return
        src_t = torch.as_tensor(src_precisions, dtype=torch.long, device=self.device).reshape(-1)
        dst_t = torch.as_tensor(dst_precisions, dtype=torch.long, device=self.device).reshape(-1)
        flat_live = self.live.view(-1)
        was_live = flat_live[src].clone()
        same = src_t == dst_t
        copies = []
        for t in src_t[same].unique().tolist():
            sel = same & (src_t == t)
            cols_src = self._token_columns(t, src[sel] % self.max_tokens)
            copies.append((dst[sel], t, self.pages[(src[sel] // self.max_tokens)[:, None], cols_src]))
        requant = None
        if (~same).any():
            keys, values = self.read(src[~same], src_t[~same])
            requant = (dst[~same], keys, values, dst_t[~same])
        flat_live[src] = False
        for d, t, data in copies:
            self.pages[(d // self.max_tokens)[:, None], self._token_columns(t, d % self.max_tokens)] = data
        if requant is not None:
            self.write(requant[0], requant[1], requant[2], requant[3])
        flat_live[dst] = was_live

    def page_slots(self, page_table: torch.Tensor) -> torch.Tensor:
        """All slots of the listed pages (-1 entries skipped) that are live, in page-table order."""
        pages = page_table[page_table >= 0].long()
        slots = (pages[:, None] * self.max_tokens + torch.arange(self.max_tokens, device=self.device)).reshape(-1)
        return slots[self.live.view(-1)[slots]]

    def decode_attention(self, q: torch.Tensor, page_table: torch.Tensor, scale: float, backend: str | None = None):
        """Queries q [G, head_dim] of one (sequence, KV head) over the live tokens of its pages
        (high and low precision group mixed). Returns out [G, head_dim] and probabilities [G, live tokens].
        `backend` as in `gpu.kernels`: the Triton kernel runs each query head as its own row so its
        per-slot score output is that head's probabilities."""
        if use_triton(q, backend):
            table = page_table.reshape(1, -1).expand(q.shape[0], -1)
            out, (probs, _) = mixed_decode_attention(self, q[:, None, :], table, scale, True, backend="triton")
            slots = (page_table.clamp(min=0).long()[:, None] * self.max_tokens
                     + torch.arange(self.max_tokens, device=self.device)).reshape(-1)
            kept = (page_table >= 0).repeat_interleave(self.max_tokens) & self.live.view(-1)[slots]
            return out[:, 0], probs[:, kept]
        keys, values = self.read(self.page_slots(page_table))
        probs = torch.softmax(q.float() @ keys.T * scale, dim=-1)
        return (probs @ values).to(q.dtype), probs

    def paged_decode_attention(self, q: torch.Tensor, page_tables: torch.Tensor, scale: float,
                               want_scores: bool = False, backend: str | None = None, group_max: bool = False):
        """Batched decode attention, one GQA group q [R, G, head_dim] per page-table row [R, max_pages];
        see `gpu.kernels.quant_attention.mixed_decode_attention`."""
        return mixed_decode_attention(self, q, page_tables, scale, want_scores, backend, group_max)
