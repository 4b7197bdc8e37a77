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

from .yaml_errors import yaml_problem

DATA_DIR = Path(__file__).parent / "data"

DTYPE_BYTES: dict[str, float] = {
    "fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1, "int4": 0.5,
}
_DTYPE_ALIASES = {
    "float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16",
    "fp8_e4m3": "fp8", "fp8_e5m2": "fp8", "float8": "fp8", "float8_e4m3fn": "fp8",
}
Dtype = Literal["fp32", "tf32", "bf16", "fp16", "fp8", "int8", "int4"]


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
    max_position: int = Field(gt=0)
    weight_dtype: Dtype
    embedding_dtype: Dtype | None = None
    activation_dtype: Dtype = "bf16"
    kv_dtype: Dtype
    mlp_matrices: int = Field(3, ge=2, le=3)      # 3: SwiGLU (gate, up, down); 2: fc1, fc2 (OPT)
    linear_bias: bool = False                     # biases on every linear (OPT)
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"   # layernorm has a bias too
    position_embeddings: int = Field(0, ge=0)     # rows of a learned position table (OPT: max_position + 2)
    qk_norm: bool = False                         # per-head RMSNorm on q and k (Qwen3, Gemma 3): 2 x head_dim

    @model_validator(mode="after")
    def _check_heads(self) -> ModelSpec:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        return self

    # ---- parameter counts -------------------------------------------------------------------
    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attn_linear_params_per_layer(self) -> int:
        """q, k, v and o projection weights (no biases)."""
        return self.hidden_size * (self.q_size + 2 * self.kv_size) + self.q_size * self.hidden_size

    @property
    def mlp_params_per_layer(self) -> int:
        return self.mlp_matrices * self.hidden_size * self.intermediate_size

    @property
    def linear_params_per_layer(self) -> int:
        return self.attn_linear_params_per_layer + self.mlp_params_per_layer

    @property
    def small_params_per_layer(self) -> int:
        """Biases and the two norms' weights (and LayerNorm biases): stored at the activation dtype."""
        bias = self.q_size + 2 * self.kv_size if self.qkv_bias or self.linear_bias else 0
        if self.linear_bias:       # o projection, then the MLP's up (and gate) and down projections
            bias += self.hidden_size + (self.mlp_matrices - 1) * self.intermediate_size + self.hidden_size
        return bias + 2 * self.final_norm_params + (2 * self.head_dim if self.qk_norm else 0)

    @property
    def final_norm_params(self) -> int:
        return self.hidden_size * (2 if self.norm == "layernorm" else 1)

    @property
    def linear_params(self) -> int:
        """Weights of all decoder-layer matmuls (excludes embedding and LM head)."""
        return self.num_layers * self.linear_params_per_layer

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
                + self.embedding_params + lm_head + self.final_norm_params)

    # ---- bytes --------------------------------------------------------------------------------
    @property
    def embedding_dtype_resolved(self) -> str:
        return self.embedding_dtype or self.weight_dtype

    @property
    def weight_bytes(self) -> int:
        """Bytes of all weights in GPU memory (unsharded)."""
        emb = DTYPE_BYTES[self.embedding_dtype_resolved]
        lm_head = 0 if self.tied_embeddings else self.lm_head_params
        small = self.num_layers * self.small_params_per_layer + self.final_norm_params
        return int(self.linear_params * DTYPE_BYTES[self.weight_dtype]
                   + (self.embedding_params + lm_head) * emb
                   + small * DTYPE_BYTES[self.activation_dtype])

    @property
    def weight_bytes_read_per_step(self) -> int:
        """Bytes a forward pass streams from memory: every linear weight and the LM head once;
        the embedding table is only gathered row by row (negligible)."""
        emb = DTYPE_BYTES[self.embedding_dtype_resolved]
        small = self.num_layers * self.small_params_per_layer + self.final_norm_params
        return int(self.linear_params * DTYPE_BYTES[self.weight_dtype] + self.lm_head_params * emb
                   + small * DTYPE_BYTES[self.activation_dtype])

    def kv_bytes_per_token(self, kv_dtype: str | None = None) -> float:
        """K and V of one token over all layers and KV heads: 2 * layers * kv_heads * head_dim * bytes."""
        nbytes = dtype_bytes(kv_dtype or self.kv_dtype)
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * nbytes

    # ---- FLOPs --------------------------------------------------------------------------------
    @property
    def linear_flops_per_token(self) -> int:
        """Multiply-adds x 2 of the decoder-layer linears for one token (LM head excluded)."""
        return 2 * self.linear_params

    @property
    def lm_head_flops_per_seq(self) -> int:
        """Logits of one position (each sequence's last token only)."""
        return 2 * self.hidden_size * self.vocab_size

    def attention_flops_per_pair(self) -> int:
        """QK^T and PV for one (query, key) pair over all layers and query heads."""
        return 4 * self.num_layers * self.num_heads * self.head_dim

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
            "int4": ("bf16", "fp16", "fp32"), "bf16": ("bf16", "fp16", "fp32"),
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

_FastLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


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
        text = Path(path).read_text()
    except OSError as exc:
        raise CatalogError(f"cannot read {path}: {exc.strerror or exc}") from exc
    try:
        data = yaml.load(text, Loader=_FastLoader)
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
            raise CatalogError(f"unknown {self.kind} {text!r}; known {self.kind}s: {', '.join(self.names())} "
                               f"(aliases allowed, case-insensitive), or a path to a YAML file")
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
    Hugging Face config.json (or a directory holding one: sim/hf_config.py)."""
    from .hf_config import hf_config_path, model_from_hf_config

    hf = hf_config_path(name_or_path)
    if hf is not None:
        return model_from_hf_config(hf)
    return _models().get(name_or_path)


def get_gpu(name_or_path: str | Path | GPUSpec) -> GPUSpec:
    """Catalog accelerator by name/alias (case-insensitive), or from a YAML file path."""
    return _gpus().get(name_or_path)


def list_models() -> list[ModelSpec]:
    return list(_models().entries)


def list_gpus() -> list[GPUSpec]:
    return list(_gpus().entries)
