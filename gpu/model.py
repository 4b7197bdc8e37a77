"""Llama-architecture decoder (RMSNorm, RoPE, GQA, SwiGLU) over a paged KV cache.

`LlamaModel.forward` runs one flattened engine step (vLLM style): prefill chunks and decodes of
several sequences concatenated into `T` tokens; attention reads and writes the paged cache as the
`AttentionMetadata` says. `LlamaModel.dense_forward` is the non-paged reference.

RoPE rotates interleaved pairs (2i, 2i+1), the order in which llama.cpp stores Q/K weights in a
GGUF; random weights are indifferent to the convention.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any
from collections.abc import Mapping

import torch
import torch.nn.functional as F

from kvsim.gpu.attention import AttentionMetadata, paged_attention


@dataclass(frozen=True)
class ModelConfig:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool = True
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    name: str = "llama"

    def __post_init__(self) -> None:
        for field in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{field} must be a positive integer, got {value!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"ModelConfig.heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")

    @classmethod
    def from_spec(cls, spec: Any) -> ModelConfig:
        """Build from a dict, a dataclass or any object with the same field names (extra fields ignored)."""
        if isinstance(spec, ModelConfig):
            return spec
        names = [f.name for f in dataclasses.fields(cls)]
        if isinstance(spec, Mapping):
            values = {n: spec[n] for n in names if n in spec}
        else:
            values = {n: getattr(spec, n) for n in names if hasattr(spec, n)}
        missing = [n for n in names[:7] if n not in values]
        if missing:
            raise ValueError(f"model spec is missing field(s) {missing}; expected {names[:8]}")
        return cls(**values)

    @property
    def num_params(self) -> int:
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.intermediate
        per_layer = attn + mlp + 2 * self.hidden
        head = 0 if self.tied else self.vocab * self.hidden
        return self.layers * per_layer + self.vocab * self.hidden + head + self.hidden


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out * weight.float()).to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; rotates interleaved pairs (2i, 2i+1) by the per-token angles."""
    pairs = x.float().unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]
    out = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)
    return out.to(x.dtype)


def random_weights(config: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Seeded random weights at any shape (for timing); std 0.02 like a fresh Llama init. The layers
    come last, so the first N layers of a model are those of its N-layer build (`--layers N` builds
    only what it runs)."""
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(dtype)

    c = config
    weights = {"embed": normal(c.vocab, c.hidden), "norm": torch.ones(c.hidden, dtype=dtype)}
    if not c.tied:
        weights["lm_head"] = normal(c.vocab, c.hidden)
    for i in range(c.layers):
        p = f"layers.{i}."
        weights.update({
            p + "attn_norm": torch.ones(c.hidden, dtype=dtype),
            p + "q": normal(c.heads * c.head_dim, c.hidden),
            p + "k": normal(c.kv_heads * c.head_dim, c.hidden),
            p + "v": normal(c.kv_heads * c.head_dim, c.hidden),
            p + "o": normal(c.hidden, c.heads * c.head_dim),
            p + "ffn_norm": torch.ones(c.hidden, dtype=dtype),
            p + "gate": normal(c.intermediate, c.hidden),
            p + "up": normal(c.intermediate, c.hidden),
            p + "down": normal(c.hidden, c.intermediate),
        })
    return weights


class LlamaModel:
    """Weights as a flat dict: embed, norm, [lm_head], layers.{i}.{attn_norm,q,k,v,o,ffn_norm,gate,up,down}."""

    def __init__(self, config: ModelConfig, weights: Mapping[str, torch.Tensor],
                 device: str | torch.device = "cpu", dtype: torch.dtype | None = None):
        self.config = config
        self.device = torch.device(device)
        self._check_weights(weights)
        self.w = {k: t.to(device=self.device, dtype=dtype or t.dtype).contiguous() for k, t in weights.items()}
        self.dtype = self.w["embed"].dtype
        self.lm_head = self.w["embed"] if config.tied else self.w["lm_head"]
        self.scale = config.head_dim ** -0.5

    def _check_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        c = self.config
        shapes = {"embed": (c.vocab, c.hidden), "norm": (c.hidden,)}
        if not c.tied:
            shapes["lm_head"] = (c.vocab, c.hidden)
        for i in range(c.layers):
            p = f"layers.{i}."
            shapes.update({
                p + "attn_norm": (c.hidden,), p + "ffn_norm": (c.hidden,),
                p + "q": (c.heads * c.head_dim, c.hidden), p + "k": (c.kv_heads * c.head_dim, c.hidden),
                p + "v": (c.kv_heads * c.head_dim, c.hidden), p + "o": (c.hidden, c.heads * c.head_dim),
                p + "gate": (c.intermediate, c.hidden), p + "up": (c.intermediate, c.hidden),
                p + "down": (c.hidden, c.intermediate),
            })
        for name, shape in shapes.items():
            if name not in weights:
                raise ValueError(f"weights are missing {name!r} (expected shape {shape})")
            if tuple(weights[name].shape) != shape:
                raise ValueError(f"weight {name!r} has shape {tuple(weights[name].shape)}, expected {shape}")

    @classmethod
    def random(cls, spec: Any, seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float32) -> LlamaModel:
        config = ModelConfig.from_spec(spec)
        return cls(config, random_weights(config, seed, dtype), device=device)

    def truncated(self, num_layers: int) -> LlamaModel:
        """The first `num_layers` layers with the same embedding and head (cheap variants for tests)."""
        config = dataclasses.replace(self.config, layers=num_layers)
        keep = {k: v for k, v in self.w.items()
                if not k.startswith("layers.") or int(k.split(".")[1]) < num_layers}
        return LlamaModel(config, keep, device=self.device)

    # -- shared pieces -------------------------------------------------------------------------
    def _qkv(self, i: int, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        """`rope`: the step's (cos, sin), computed once for all layers (`rope_cos_sin`)."""
        c, w, p = self.config, self.w, f"layers.{i}."
        x = rms_norm(h, w[p + "attn_norm"], c.rms_eps)
        q = (x @ w[p + "q"].T).view(-1, c.heads, c.head_dim)
        k = (x @ w[p + "k"].T).view(-1, c.kv_heads, c.head_dim)
        v = (x @ w[p + "v"].T).view(-1, c.kv_heads, c.head_dim)
        return apply_rope(q, *rope), apply_rope(k, *rope), v

    def _finish_layer(self, i: int, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        c, w, p = self.config, self.w, f"layers.{i}."
        h = h + attn.reshape(h.shape[0], -1) @ w[p + "o"].T
        x = rms_norm(h, w[p + "ffn_norm"], c.rms_eps)
        return h + (F.silu(x @ w[p + "gate"].T) * (x @ w[p + "up"].T)) @ w[p + "down"].T

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return (rms_norm(h, self.w["norm"], self.config.rms_eps) @ self.lm_head.T).float()

    # -- paged step ----------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                cache) -> torch.Tensor:
        """One engine step. Returns logits [num_seqs, vocab] of each sequence's last scheduled token.

        When `meta.score_window > 0`, `meta.scores` is filled with per-slot attention statistics.
        """
        c = self.config
        if input_ids.dim() != 1 or input_ids.shape != positions.shape:
            raise ValueError(f"input_ids and positions must be 1-D of equal length, got "
                             f"{tuple(input_ids.shape)} and {tuple(positions.shape)}")
        meta.prepare(cache)
        h = self.w["embed"][input_ids.to(self.device)]
        rope = rope_cos_sin(positions.to(self.device), c.head_dim, c.rope_theta)
        for i in range(c.layers):
            q, k, v = self._qkv(i, h, rope)
            attn = paged_attention(i, q, k, v, meta, cache, self.scale)
            h = self._finish_layer(i, h, attn)
        last = meta.query_start_loc[1:].to(self.device) - 1
        return self._logits(h[last])

    __call__ = forward

    # -- dense reference -----------------------------------------------------------------------
    @torch.inference_mode()
    def dense_forward(self, input_ids: torch.Tensor, return_probs: bool = False, return_queries: bool = False):
        """Full causal forward of one sequence without a cache: logits [T, vocab].

        With `return_probs`, also the attention probabilities [layers, heads, T, T] (fp32); with
        `return_queries`, also the queries after RoPE [layers, heads, T, head_dim] (fp32).
        """
        c = self.config
        ids = torch.as_tensor(input_ids, device=self.device)
        n = ids.shape[0]
        positions = torch.arange(n, device=self.device)
        h = self.w["embed"][ids]
        group = c.heads // c.kv_heads
        causal = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
        probs, queries = [], []
        rope = rope_cos_sin(positions, c.head_dim, c.rope_theta)
        for i in range(c.layers):
            q, k, v = self._qkv(i, h, rope)
            qh = q.float().transpose(0, 1)                                   # [heads, T, D]
            if return_queries:
                queries.append(qh)
            kh = k.float().repeat_interleave(group, dim=1).transpose(0, 1)
            vh = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
            s = (qh @ kh.transpose(1, 2)) * self.scale
            p = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1)
            if return_probs:
                probs.append(p)
            attn = (p @ vh).transpose(0, 1).to(h.dtype)
            h = self._finish_layer(i, h, attn)
        logits = self._logits(h)
        out = (logits,) + ((torch.stack(probs),) if return_probs else ()) + \
            ((torch.stack(queries),) if return_queries else ())
        return out if len(out) > 1 else logits
