"""Model and accelerator catalogs: architecture and hardware figures the simulator sizes against.

Lookup is by case-insensitive name or alias (`get_model("llama-3.1-8b")`, `get_gpu("h100")`), or
by the path of a user YAML file with the same fields (a single entry, a `models:` / `gpus:` list
of one, or `file.yaml#Name` to pick one entry of a list). Bad files fail with `CatalogError`
naming the file, line and field.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .hf_config import HFConfigError, hf_config_path, model_fields_from_hf_config
from ..io.safe_io import InputError, read_input_text, safe_yaml_load
from ..io.yaml_errors import yaml_problem

DATA_DIR = Path(__file__).parent.parent / "data"

DTYPE_BYTES: dict[str, float] = {
    "fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1, "int4": 0.5,
    "mxfp4": 4.25 / 8,      # OCP MX FP4: 4-bit values + one 8-bit scale per 32 (gpt-oss's expert weights)
}
_DTYPE_ALIASES = {
    "float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16",
    "fp8_e4m3": "fp8", "fp8_e5m2": "fp8", "float8": "fp8", "float8_e4m3fn": "fp8",
}
Dtype = Literal["fp32", "tf32", "bf16", "fp16", "fp8", "int8", "int4", "mxfp4"]


class CatalogError(ValueError):
    """Unknown catalog name or invalid catalog file."""


def normalize_dtype(name: str) -> str:
    key = str(name).strip().lower()
    key = _DTYPE_ALIASES.get(key, key)
    if key not in DTYPE_BYTES:
        raise CatalogError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPE_BYTES)}")
    return key


def dtype_bytes(name: str) -> float:
    return DTYPE_BYTES[normalize_dtype(name)]


def _normalize_name(name: str) -> str:
    return str(name).strip().lower().replace("_", "-").replace(" ", "-")


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _normalize_dtypes(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = dict(data)
            for key, value in data.items():
                if key.endswith("dtype") and isinstance(value, str):
                    data[key] = _DTYPE_ALIASES.get(value.strip().lower(), value.strip().lower())
                if key == "tflops" and isinstance(value, dict):
                    data[key] = {_DTYPE_ALIASES.get(str(k).lower(), str(k).lower()): v for k, v in value.items()}
        return data


class ModelSpec(_Spec):
    """Decoder-only transformer (Llama family: RMSNorm, GQA attention, SwiGLU MLP; OPT family:
    LayerNorm, biases on every linear, a two-matrix ReLU MLP and learned position embeddings)."""

    name: str
    hf_id: str | None = None
    aliases: tuple[str, ...] = ()
    num_layers: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    num_heads: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    vocab_size: int = Field(gt=0)
    tied_embeddings: bool
    qkv_bias: bool = False
    max_position: int = Field(gt=0)               # the longest max_model_len vLLM accepts (after RoPE scaling)
    default_max_model_len: int | None = Field(None, gt=0)   # vLLM's default when below it (LongRoPE)
    weight_dtype: Dtype
    embedding_dtype: Dtype | None = None
    activation_dtype: Dtype = "bf16"
    kv_dtype: Dtype
    mlp_matrices: int = Field(3, ge=2, le=3)      # 3: SwiGLU (gate, up, down); 2: fc1, fc2 (OPT)
    linear_bias: bool = False                     # biases on every linear (OPT)
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"   # layernorm has a bias too
    position_embeddings: int = Field(0, ge=0)     # rows of a learned position table (OPT: max_position + 2)
    qk_norm: bool = False                         # per-head RMSNorm on q and k (Qwen3, Gemma 3): 2 x head_dim
    # ---- mixture of experts (num_experts 0: a dense MLP in every layer; docs/models.md) ----
    num_experts: int = Field(0, ge=0)             # routed experts per MoE layer
    experts_per_token: int = Field(0, ge=0)       # top-k
    moe_intermediate_size: int = Field(0, ge=0)   # one expert's MLP width (0: intermediate_size)
    num_shared_experts: int = Field(0, ge=0)      # always-active experts of moe_intermediate_size (DeepSeek)
    first_dense_layers: int = Field(0, ge=0)      # leading layers with a dense MLP of intermediate_size
    expert_dtype: Dtype | None = None             # routed experts' storage dtype (default weight_dtype)
    # router skew: expert i (by popularity rank) gets a share of the routed tokens proportional to i^-skew
    # (0: uniform routing; sim/model/moe_kernels.py, docs/models.md)
    expert_skew: float = Field(0.0, ge=0, le=4, allow_inf_nan=False)
    # fp8 weights quantized in square blocks of this many weights a side (DeepSeek-V3, Qwen3-*-FP8: 128;
    # 0: per-tensor or per-channel scales). Only the MoE kernels' format reads it (moe_kernels.py).
    weight_block_size: int = Field(0, ge=0)
    # ---- multi-head latent attention (kv_lora_rank 0: standard attention; DeepSeek-V2/V3) ----
    kv_lora_rank: int = Field(0, ge=0)            # the compressed KV's width (cached with the RoPE key)
    q_lora_rank: int = Field(0, ge=0)             # 0: q projected directly from the hidden state
    qk_rope_head_dim: int = Field(0, ge=0)
    qk_nope_head_dim: int = Field(0, ge=0)
    v_head_dim: int = Field(0, ge=0)
    # ---- sliding-window attention (0: every layer attends to the whole context) ----
    sliding_window: int = Field(0, ge=0)          # tokens a sliding-window layer attends to
    sliding_window_layers: int | None = Field(None, ge=0)   # how many layers use it (None: all)

    @model_validator(mode="after")
    def _check_heads(self) -> ModelSpec:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(f"experts_per_token ({self.experts_per_token}) must be in 1..num_experts "
                             f"({self.num_experts})")
        if self.num_experts and self.first_dense_layers >= self.num_layers:
            raise ValueError(f"first_dense_layers ({self.first_dense_layers}) must be below num_layers")
        if self.kv_lora_rank and not (self.qk_rope_head_dim and self.qk_nope_head_dim and self.v_head_dim):
            raise ValueError("multi-head latent attention (kv_lora_rank) needs qk_rope_head_dim, qk_nope_head_dim "
                             "and v_head_dim")
        if self.kv_lora_rank and self.num_kv_heads != 1:
            raise ValueError("multi-head latent attention caches one latent per token: num_kv_heads must be 1")
        if self.sliding_window_layers is not None and not (
                self.sliding_window and self.sliding_window_layers <= self.num_layers):
            raise ValueError(f"sliding_window_layers ({self.sliding_window_layers}) needs a sliding_window and "
                             f"at most num_layers ({self.num_layers})")
        return self

    @property
    def max_model_len(self) -> int:
        """vLLM's max_model_len when none is given: default_max_model_len (LongRoPE's unscaled length), else
        max_position."""
        return self.default_max_model_len or self.max_position

    # ---- architecture variants ----------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_dense_layers if self.is_moe else 0

    @property
    def expert_width(self) -> int:
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def expert_params(self) -> int:
        """One routed (or shared) expert's MLP weights."""
        return self.mlp_matrices * self.hidden_size * self.expert_width

    @property
    def routed_expert_params(self) -> int:
        """Every routed expert of every MoE layer (the weights routing selects among)."""
        return self.num_moe_layers * self.num_experts * self.expert_params

    @property
    def expert_bytes(self) -> float:
        """One routed expert's weight bytes (at expert_dtype)."""
        return self.expert_params * DTYPE_BYTES[self.expert_dtype or self.weight_dtype]

    @property
    def num_sliding_layers(self) -> int:
        if not self.sliding_window:
            return 0
        return self.num_layers if self.sliding_window_layers is None else self.sliding_window_layers

    # ---- parameter counts -------------------------------------------------------------------
    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attn_linear_params_per_layer(self) -> int:
        """q, k, v and o projection weights (no biases). MLA: q (through q_lora_rank when set), the
        joint KV down-projection with the RoPE key, the KV up-projection and o."""
        if not self.is_mla:
            return self.hidden_size * (self.q_size + 2 * self.kv_size) + self.q_size * self.hidden_size
        h, heads, qk = self.hidden_size, self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim
        q = (h * self.q_lora_rank + self.q_lora_rank * heads * qk) if self.q_lora_rank else h * heads * qk
        kv = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank * heads * (
            self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + heads * self.v_head_dim * h

    @property
    def mlp_params_per_layer(self) -> int:
        """A dense layer's MLP."""
        return self.mlp_matrices * self.hidden_size * self.intermediate_size

    @property
    def linear_params_per_layer(self) -> int:
        """A dense layer's matmul weights (attention + MLP)."""
        return self.attn_linear_params_per_layer + self.mlp_params_per_layer

    @property
    def active_linear_params(self) -> int:
        """Decoder-layer matmul weights one token multiplies by: attention, dense MLPs, and in each MoE
        layer its experts_per_token routed experts and the shared ones."""
        if not self.is_moe:
            return self.linear_params
        return (self.num_layers * self.attn_linear_params_per_layer
                + self.first_dense_layers * self.mlp_params_per_layer
                + self.num_moe_layers * (self.experts_per_token + self.num_shared_experts) * self.expert_params)

    @property
    def active_linear_params_per_layer(self) -> float:
        """active_linear_params per layer (a dense model's linear_params_per_layer)."""
        return self.active_linear_params / self.num_layers if self.is_moe else self.linear_params_per_layer

    @property
    def active_mlp_width(self) -> float:
        """MLP width one token passes through, averaged over layers (intermediate_size when dense)."""
        if not self.is_moe:
            return self.intermediate_size
        moe = (self.experts_per_token + self.num_shared_experts) * self.expert_width
        return (self.first_dense_layers * self.intermediate_size + self.num_moe_layers * moe) / self.num_layers

    @property
    def small_params_per_layer(self) -> int:
        """Biases and the two norms' weights (and LayerNorm biases): stored at the activation dtype."""
        bias = self.q_size + 2 * self.kv_size if self.qkv_bias or self.linear_bias else 0
        if self.linear_bias:       # o projection, then the MLP's up (and gate) and down projections
            bias += self.hidden_size + (self.mlp_matrices - 1) * self.intermediate_size + self.hidden_size
        return bias + 2 * self.final_norm_params + (2 * self.head_dim if self.qk_norm else 0) + self._variant_small_params

    @property
    def _variant_small_params(self) -> int:
        """MLA's norms of the compressed q and KV."""
        return self.kv_lora_rank + self.q_lora_rank if self.is_mla else 0

    @property
    def router_params(self) -> int:
        """The MoE layers' routers (hidden x experts each), kept at the activation dtype."""
        return self.num_moe_layers * self.hidden_size * self.num_experts

    @property
    def final_norm_params(self) -> int:
        return self.hidden_size * (2 if self.norm == "layernorm" else 1)

    @property
    def linear_params(self) -> int:
        """Weights of all decoder-layer matmuls, every expert included (excludes embedding and LM head)."""
        if not self.is_moe:
            return self.num_layers * self.linear_params_per_layer
        return (self.num_layers * self.attn_linear_params_per_layer
                + self.first_dense_layers * self.mlp_params_per_layer
                + self.num_moe_layers * (self.num_experts + self.num_shared_experts) * self.expert_params)

    @property
    def embedding_params(self) -> int:
        return (self.vocab_size + self.position_embeddings) * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        """LM head matrix size (shared with the embedding when tied, still multiplied each step)."""
        return self.vocab_size * self.hidden_size

    @property
    def param_count(self) -> int:
        """Unique parameters, as the model card counts them."""
        lm_head = 0 if self.tied_embeddings else self.lm_head_params
        return (self.linear_params + self.num_layers * self.small_params_per_layer
                + self.embedding_params + lm_head + self.final_norm_params + self.router_params)

    # ---- bytes --------------------------------------------------------------------------------
    @property
    def embedding_dtype_resolved(self) -> str:
        return self.embedding_dtype or self.weight_dtype

    @property
    def weight_bytes(self) -> int:
        """Bytes of all weights in GPU memory (unsharded)."""
        emb = DTYPE_BYTES[self.embedding_dtype_resolved]
        lm_head = 0 if self.tied_embeddings else self.lm_head_params
        small = self.num_layers * self.small_params_per_layer + self.final_norm_params + self.router_params
        return int(self.linear_params * DTYPE_BYTES[self.weight_dtype]
                   + (self.embedding_params + lm_head) * emb
                   + small * DTYPE_BYTES[self.activation_dtype] + self._expert_dtype_correction)

    @property
    def _expert_dtype_correction(self) -> float:
        """Routed experts stored at expert_dtype instead of weight_dtype (gpt-oss: MXFP4 experts)."""
        if not self.is_moe or self.expert_dtype is None:
            return 0.0
        return self.routed_expert_params * (DTYPE_BYTES[self.expert_dtype] - DTYPE_BYTES[self.weight_dtype])

    @property
    def weight_bytes_read_per_step(self) -> int:
        """Bytes a forward pass streams from memory when it touches every expert: every linear weight
        and the LM head once; the embedding table is only gathered row by row (negligible)."""
        emb = DTYPE_BYTES[self.embedding_dtype_resolved]
        small = self.num_layers * self.small_params_per_layer + self.final_norm_params + self.router_params
        return int(self.linear_params * DTYPE_BYTES[self.weight_dtype] + self.lm_head_params * emb
                   + small * DTYPE_BYTES[self.activation_dtype] + self._expert_dtype_correction)

    @property
    def dense_weight_bytes_read_per_step(self) -> int:
        """weight_bytes_read_per_step without the routed experts (read in every step that runs; the
        experts' share depends on the batch: sim.model.cost_model.expected_distinct_experts)."""
        return int(self.weight_bytes_read_per_step - self.num_moe_layers * self.num_experts * self.expert_bytes)

    def kv_bytes_per_token(self, kv_dtype: str | None = None) -> float:
        """K and V of one token over all layers and KV heads: 2 * layers * kv_heads * head_dim * bytes.
        MLA caches one latent (kv_lora_rank) and the RoPE key per layer: layers * (rank + rope) * bytes."""
        nbytes = dtype_bytes(kv_dtype or self.kv_dtype)
        if self.is_mla:
            return self.num_layers * (self.kv_lora_rank + self.qk_rope_head_dim) * nbytes
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * nbytes

    # ---- FLOPs --------------------------------------------------------------------------------
    @property
    def linear_flops_per_token(self) -> int:
        """Multiply-adds x 2 of the decoder-layer linears for one token (LM head excluded; MoE: the
        active experts only)."""
        return 2 * self.active_linear_params

    @property
    def lm_head_flops_per_seq(self) -> int:
        """Logits of one position (each sequence's last token only)."""
        return 2 * self.hidden_size * self.vocab_size

    def attention_flops_per_pair(self) -> int:
        """QK^T and PV for one (query, key) pair over all layers and query heads. MLA prefill (vLLM
        decompresses K and V and runs multi-head attention): 2 * (qk_nope + qk_rope + v) per head."""
        if self.is_mla:
            return 2 * self.num_layers * self.num_heads * (
                self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim)
        return 4 * self.num_layers * self.num_heads * self.head_dim

    def attention_flops_per_kv_read(self) -> int:
        """Attention FLOPs per KV token a decode query reads. MLA decode runs in the latent space (the
        up-projections absorbed into q and o): QK over rank + rope, PV over rank, per query head."""
        if self.is_mla:
            return 2 * self.num_layers * self.num_heads * (2 * self.kv_lora_rank + self.qk_rope_head_dim)
        return self.attention_flops_per_pair()

    def kv_cache_groups(self) -> tuple[int, int, int]:
        """(layers per group, full-attention groups, sliding-window groups) of vLLM's hybrid KV cache
        allocator: layers of one attention type are cut into groups of equal size (the smaller type's
        layer count, or the larger one's when they are within 1.25x), a pool block holds block_size
        tokens of one group. Without sliding layers: one group of every layer."""
        sliding = self.num_sliding_layers
        full = self.num_layers - sliding
        if not sliding or not full:
            return self.num_layers, int(full > 0), int(sliding > 0)
        size = max(full, sliding) if max(full, sliding) < 1.25 * min(full, sliding) else min(full, sliding)
        return size, -(-full // size), -(-sliding // size)

    def with_dtypes(self, *, weight_dtype: str | None = None, kv_dtype: str | None = None,
                    activation_dtype: str | None = None) -> ModelSpec:
        """Copy with other dtypes (e.g. the fp32 CPU backend, an fp8 KV cache)."""
        update = {}
        if weight_dtype:
            update["weight_dtype"] = normalize_dtype(weight_dtype)
        if kv_dtype:
            update["kv_dtype"] = normalize_dtype(kv_dtype)
        if activation_dtype:
            update["activation_dtype"] = normalize_dtype(activation_dtype)
        return self.model_copy(update=update)


class GPUSpec(_Spec):
    name: str
    aliases: tuple[str, ...] = ()
    kind: Literal["gpu", "cpu"] = "gpu"
    memory_gib: float = Field(gt=0)
    memory_bw_gbps: float = Field(gt=0)
    tflops: dict[Dtype, float]
    interconnect_gbps: float | None = Field(default=None, gt=0)
    pcie_gbps: float = Field(gt=0)
    usd_per_hour: float = Field(ge=0)

    @model_validator(mode="after")
    def _check_tflops(self) -> GPUSpec:
        bad = [k for k, v in self.tflops.items() if not v > 0]
        if bad:
            raise ValueError(f"tflops must be > 0 (got {', '.join(f'{k}={self.tflops[k]}' for k in bad)})")
        if not any(k in self.tflops for k in ("bf16", "fp16", "fp32")):
            raise ValueError("tflops needs at least one of bf16, fp16, fp32")
        return self

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * 2**30)

    @property
    def mem_bw(self) -> float:
        """Bytes per second."""
        return self.memory_bw_gbps * 1e9

    @property
    def link_bw(self) -> float:
        """GPU-to-GPU bytes per second per direction (NVLink, else PCIe)."""
        return (self.interconnect_gbps or self.pcie_gbps) * 1e9

    @property
    def pcie_bw(self) -> float:
        return self.pcie_gbps * 1e9

    def compute_dtype(self, dtype: str) -> str:
        """The tensor-core dtype a matmul in `dtype` runs at here, following what vLLM does:
        bf16 on a device without bf16 runs as fp16; fp8/int8/int4 weights without native support
        are dequantized in the kernel (weight-only, e.g. Marlin) and run at 16-bit."""
        dtype = normalize_dtype(dtype)
        order = {
            "fp8": ("fp8", "bf16", "fp16", "fp32"), "int8": ("int8", "bf16", "fp16", "fp32"),
            "int4": ("bf16", "fp16", "fp32"), "mxfp4": ("bf16", "fp16", "fp32"),
            "bf16": ("bf16", "fp16", "fp32"),
            "fp16": ("fp16", "bf16", "fp32"), "fp32": ("fp32", "tf32", "bf16", "fp16"),
            "tf32": ("tf32", "fp32"),
        }[dtype]
        for candidate in order:
            if candidate in self.tflops:
                return candidate
        raise CatalogError(f"{self.name}: no peak TFLOP/s for {dtype} or a fallback ({', '.join(order)})")

    def peak_flops(self, dtype: str) -> float:
        """FLOP/s of a matmul whose operands are `dtype` (after the fallback in compute_dtype)."""
        return self.tflops[self.compute_dtype(dtype)] * 1e12


# ---- YAML loading with line numbers ----------------------------------------------------------

class _LineMap(dict):
    """Key path -> 1-based line, composed on first use (only error messages need it)."""

    def __init__(self, text: str):
        super().__init__()
        self._text: str | None = text

    def _fill(self) -> None:
        if self._text is None:
            return
        root, self._text = yaml.compose(self._text), None

        def walk(node: Any, prefix: tuple) -> None:
            self[prefix] = node.start_mark.line + 1
            if isinstance(node, yaml.MappingNode):
                for key_node, value_node in node.value:
                    walk(value_node, prefix + (key_node.value,))
                    self[prefix + (key_node.value,)] = key_node.start_mark.line + 1
            elif isinstance(node, yaml.SequenceNode):
                for i, item in enumerate(node.value):
                    walk(item, prefix + (i,))

        if root is not None:
            walk(root, ())

    def __getitem__(self, key):
        self._fill()
        return super().__getitem__(key)

    def __contains__(self, key) -> bool:
        self._fill()
        return super().__contains__(key)

    def get(self, key, default=None):
        self._fill()
        return super().get(key, default)


def yaml_load_with_lines(path: Path) -> tuple[Any, dict[tuple, int]]:
    """Parse YAML; also map each key path (tuple of keys / list indices) to its 1-based line (built
    lazily: the pure-Python composer costs more than the C parser, and only errors need lines)."""
    try:
        text = read_input_text(path, what="YAML file")
        data = safe_yaml_load(text, str(path), fast=True)
    except InputError as exc:
        raise CatalogError(str(exc)) from None
    except OSError as exc:
        raise CatalogError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except yaml.YAMLError as exc:
        raise CatalogError(f"{path}: invalid YAML: {yaml_problem(exc)}") from None
    return data, _LineMap(text)


def format_validation_error(exc: ValidationError, source: str, lines: dict[tuple, int],
                            prefix: tuple = ()) -> str:
    """One line per problem: `file:line: field 'x': message`."""
    out = []
    for err in exc.errors():
        loc = prefix + tuple(err["loc"])
        line = next((lines[loc[:n]] for n in range(len(loc), -1, -1) if loc[:n] in lines), None)
        where = f"{source}:{line}" if line else source
        field = ".".join(str(p) for p in err["loc"]) or "(entry)"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown field (extra keys are not allowed)"
        out.append(f"{where}: field '{field}': {msg}")
    return "\n".join(out)


def _parse_entries(path: Path, list_key: str, cls: type[_Spec]) -> list[_Spec]:
    data, lines = yaml_load_with_lines(path)
    if isinstance(data, dict) and list_key in data:
        raw, prefix = data[list_key], (list_key,)
        if not isinstance(raw, list):
            raise CatalogError(f"{path}:{lines.get(prefix, 1)}: '{list_key}' must be a list of entries")
        entries = [(item, prefix + (i,)) for i, item in enumerate(raw)]
    elif isinstance(data, dict):
        entries = [(data, ())]
    else:
        raise CatalogError(f"{path}: expected a mapping with {cls.__name__} fields or a '{list_key}:' list")
    specs = []
    for item, prefix in entries:
        if not isinstance(item, dict):
            raise CatalogError(f"{path}:{lines.get(prefix, 1)}: each entry must be a mapping")
        try:
            specs.append(cls.model_validate(item))
        except ValidationError as exc:
            raise CatalogError(f"invalid {cls.__name__} in {path}:\n"
                               + format_validation_error(exc, str(path), lines, prefix)) from exc
    return specs


class _Catalog:
    def __init__(self, kind: str, list_key: str, cls: type[_Spec], path: Path):
        self.kind, self.list_key, self.cls = kind, list_key, cls
        self.entries = _parse_entries(path, list_key, cls)
        self.index: dict[str, _Spec] = {}
        for spec in self.entries:
            for key in (spec.name, getattr(spec, "hf_id", None), *spec.aliases):
                if key:
                    self.index.setdefault(_normalize_name(key), spec)

    def names(self) -> list[str]:
        return [spec.name for spec in self.entries]

    def get(self, name_or_path: str | Path | _Spec) -> _Spec:
        if isinstance(name_or_path, self.cls):
            return name_or_path
        text = str(name_or_path)
        file_part, _, entry = text.partition("#")
        if file_part.endswith((".yaml", ".yml")) or Path(file_part).is_file():
            return self._from_file(Path(file_part), entry)
        spec = self.index.get(_normalize_name(text))
        if spec is None:
            files = "a YAML file" + (", a Hugging Face config.json or its directory" if self.kind == "model" else "")
            if ("/" in text or text.startswith("~")) and not Path(file_part).expanduser().exists():
                raise CatalogError(f"{self.kind} {text!r}: no such file or directory (expected a catalog name "
                                   f"or {files})")
            raise CatalogError(f"unknown {self.kind} {text!r}; known {self.kind}s: {', '.join(self.names())} "
                               f"(aliases allowed, case-insensitive), or a path to {files}")
        return spec

    def _from_file(self, path: Path, entry: str) -> _Spec:
        specs = _parse_entries(path, self.list_key, self.cls)
        if entry:
            for spec in specs:
                if _normalize_name(entry) in {_normalize_name(n) for n in (spec.name, *spec.aliases)}:
                    return spec
            raise CatalogError(f"{path}: no {self.kind} named {entry!r}; it has {', '.join(s.name for s in specs)}")
        if len(specs) != 1:
            raise CatalogError(f"{path} holds {len(specs)} {self.kind}s ({', '.join(s.name for s in specs)}); "
                               f"pick one with '{path}#NAME'")
        return specs[0]


@lru_cache(maxsize=1)
def _models() -> _Catalog:
    return _Catalog("model", "models", ModelSpec, DATA_DIR / "models.yaml")


@lru_cache(maxsize=1)
def _gpus() -> _Catalog:
    return _Catalog("gpu", "gpus", GPUSpec, DATA_DIR / "gpus.yaml")


def get_model(name_or_path: str | Path | ModelSpec) -> ModelSpec:
    """Catalog model by name/alias (case-insensitive), from a YAML file path (`file.yaml#Name`), or from a
    Hugging Face config.json (or a directory holding one: sim/model/hf_config.py)."""
    try:
        hf = hf_config_path(name_or_path)
        if hf is not None:
            return ModelSpec(**model_fields_from_hf_config(hf))
    except (HFConfigError, ValidationError) as exc:
        message = str(exc) if isinstance(exc, HFConfigError) else f"{hf}: " + "; ".join(
            ".".join(map(str, e["loc"])) + (": " if e["loc"] else "") + e["msg"].removeprefix("Value error, ")
            for e in exc.errors())      # was the last line of pydantic's text: its documentation link
        raise CatalogError(message) from None
    return _models().get(name_or_path)


def get_gpu(name_or_path: str | Path | GPUSpec) -> GPUSpec:
    """Catalog accelerator by name/alias (case-insensitive), or from a YAML file path."""
    return _gpus().get(name_or_path)


# CUDA device names (torch.cuda.get_device_name) -> catalog GPU. A label inside another comes after it
# ("L40" before "L4"); None: an A100, told apart by its memory.
_CUDA_LABELS = (("H200", "h200"), ("H100", "h100"), ("A100", None), ("L40", "l40"), ("L4", "l4"), ("A40", "a40"),
                ("T4", "t4"))


def gpu_for_device_name(device_name: str, memory_gib: float) -> str | None:
    """The catalog GPU of a CUDA device from its name and memory (GiB), or None when the catalog has none."""
    name = device_name.upper()
    for label, key in _CUDA_LABELS:
        if label in name:
            return key or ("a100-80gb" if memory_gib > 48 else "a100-40gb")
    return None


def list_models() -> list[ModelSpec]:
    return list(_models().entries)


def list_gpus() -> list[GPUSpec]:
    return list(_gpus().entries)
