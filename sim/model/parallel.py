"""Parallelism beyond tensor parallelism, as vLLM runs it (docs/parallelism.md).

**Pipeline parallelism** (`--pipeline-parallel-size P`, config `pp`): a replica's decoder layers are split
into P stages of TP GPUs each (`pp_layer_split`: vLLM's `get_pp_indices`, the remainder going to the stages
before the last, which also holds the LM head); each stage holds its layers' weights and KV cache, so a
GPU's KV pool holds only its stage's layers and the replica's pool grows with P (vLLM takes the
smallest stage's block count: sim/model/memory.py `_parallel_stage`). vLLM's engine keeps P batches in flight (its batch
queue, `max_concurrent_batches`), a request in at most one of them.

kvsim steps a PP replica in **rounds** of its in-flight batches: one engine step stands for a round in which
every scheduled request advances once; the simulator's `PipelineExecutor` splits the step's requests into the
batches as vLLM forms them (a request keeps its batch; admissions fill the batches in formation order up to
max_num_batched_tokens each; a decode fast-forward prices each batch apart: `round_decode_run`), and `PipelineCostModel.round_seconds` prices the round

    round   = max(max over batches of path(b), sum over batches of busy(b))
    path(b) = T(b) + (P - 1) * send(b)          batch b through every stage and every boundary
    busy(b) = w_max * T(b) + send(b)            the busiest stage's share of batch b

with T(b) the cost model's step time of the whole model on batch b (its layers' compute on every stage in
turn), w_max the largest stage's share of the layers, and send(b) the activation hand-off between two stages:
tokens(b) x hidden x activation bytes / TP per GPU over the stage link (each TP rank sends its slice, vLLM's
`send_tensor_dict` with the TP all-gather), plus the link's latency. The link is the GPU's own interconnect
while the replica's TP x PP GPUs fit one node (`GPUS_PER_NODE`), else the network (`ib-ndr` in the link
catalog). The scheduler's token budget is P x max_num_batched_tokens per round. `predict(shape)` (a step known
by its counts only) splits it into m = min(P, sequences) equal batches. Errors against an exact timing of
vLLM's batch queue: bench/bench_parallelism.py, docs/parallelism.md.

**Data-parallel attention with expert parallelism** (`--data-parallel-size D` of a MoE model, config `dp`):
D attention ranks, each its own scheduler and KV cache, run the MoE layers together over all D x TP GPUs
(experts per GPU = experts / (D x TP)). Every step all ranks synchronise (`DPAttentionPricing`): a rank's
attention and dense part costs its own batch, the MoE part costs the tokens of every rank, and the
all-to-all moves each token's top-k expert inputs and outputs (dispatch + combine: 2 x top_k x hidden x
activation bytes per token) over the link; the step of every rank takes the slowest rank's time (idle
ranks run dummy batches).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .catalog import DTYPE_BYTES, GPUSpec, ModelSpec
from .cost_model import CostModel, expected_distinct_experts
from .links import link_catalog

GPUS_PER_NODE = 8              # GPUs one node joins by NVLink (DGX/HGX H100, H200, B200)
NETWORK_LINK = "ib-ndr"        # the link between nodes (one NIC per GPU): sim/data/links.yaml


class ParallelismError(ValueError):
    """An impossible parallel layout (more stages than layers, fewer experts than GPUs, ...)."""


def pp_layer_split(num_layers: int, pp: int) -> list[int]:
    """Decoder layers of each of `pp` stages as vLLM splits them (vllm.distributed.utils.get_pp_indices):
    num_layers // pp each, the remainder one more to each stage counted back from the second-to-last."""
    if pp < 1:
        raise ParallelismError(f"pp (--pipeline-parallel-size) must be >= 1, got {pp}")
    if pp > num_layers:
        raise ParallelismError(f"pp (--pipeline-parallel-size) {pp} exceeds the model's {num_layers} decoder layers "
                               "(every stage needs at least one)")
    parts = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        parts[-i] += 1
    return parts


def stage_weight_bytes(model: ModelSpec, layers: int, first: bool, last: bool) -> int:
    """Weight bytes of one pipeline stage of `layers` decoder layers (unsharded by TP): its share of the
    decoder layers, the embedding on the first stage, the LM head (and final norm) on the last one (vLLM's
    last stage holds its own LM head even when the checkpoint ties it to the embedding)."""
    emb = DTYPE_BYTES[model.embedding_dtype_resolved]
    embedding = model.embedding_params * emb
    head = 0 if model.tied_embeddings else model.lm_head_params * emb
    final_norm = model.final_norm_params * DTYPE_BYTES[model.activation_dtype]
    decoder = model.weight_bytes - embedding - head - final_norm
    out = decoder * layers / model.num_layers
    if first:
        out += embedding
    if last:
        out += model.lm_head_params * emb + final_norm
    return int(out)


@dataclass(frozen=True)
class StageLink:
    """The link activations cross between two pipeline stages (or the all-to-all of DP ranks): bytes per
    second of one GPU's link and the latency of one transfer."""
    name: str
    bytes_per_s: float
    latency_s: float

    def seconds(self, nbytes):
        return self.latency_s + nbytes / self.bytes_per_s


def group_link(gpu: GPUSpec, gpus: int) -> StageLink:
    """The link between the GPUs of a group of `gpus`: the GPU's own interconnect (NVLink) within a node of
    GPUS_PER_NODE, else the network between nodes (NETWORK_LINK)."""
    if gpus <= GPUS_PER_NODE:
        return StageLink(f"{gpu.name} interconnect", gpu.link_bw, 2.0e-6)
    entry = link_catalog()[NETWORK_LINK]
    return StageLink(NETWORK_LINK, entry["bandwidth_gb_s"] * 1e9, entry["latency_s"])


def _scaled(shape, m):
    """`shape` (a BatchShape) with its counts divided by m (one of m equal micro-batches)."""
    def part(x):
        return None if x is None else x / m
    return replace(shape, num_seqs=shape.num_seqs / m, num_prefill_tokens=shape.num_prefill_tokens / m,
                   num_decode_tokens=shape.num_decode_tokens / m, kv_tokens_read=shape.kv_tokens_read / m,
                   attn_pairs_prefill=shape.attn_pairs_prefill / m, block_table_entries=shape.block_table_entries / m,
                   bytes_moved=shape.bytes_moved / m, swap_bytes=shape.swap_bytes / m, op_flops=shape.op_flops / m,
                   op_bytes=shape.op_bytes / m, op_kernels=shape.op_kernels / m, kv_tokens_padded=part(shape.kv_tokens_padded),
                   attn_pairs_prefill_padded=part(shape.attn_pairs_prefill_padded))


class PipelineCostModel(CostModel):
    """A replica of TP x PP GPUs: a step is a round of its in-flight batches, priced from the whole model's step
    time on each batch (module docstring). `pp` 1 is never built (the plain CostModel prices it)."""

    def __init__(self, *args, pp: int, batch_tokens: int = 8192, **kwargs):
        super().__init__(*args, **kwargs)
        self.pp = pp
        self.batch_tokens = batch_tokens        # max_num_batched_tokens of one in-flight batch
        self.stage_layers = pp_layer_split(self.model.num_layers, pp)
        self.bottleneck_share = max(self.stage_layers) / self.model.num_layers
        m = self.model
        self.link = group_link(self.gpu, self.tp * pp)
        # bytes one GPU sends per token at a stage boundary: the hidden state's TP slice
        self._send_token_s = m.hidden_size * DTYPE_BYTES[m.activation_dtype] / self.tp / self.link.bytes_per_s

    def send_seconds(self, tokens):
        """One stage-to-stage hand-off of a micro-batch of `tokens` tokens (0 tokens: nothing sent)."""
        return np.where(tokens > 0, self.link.latency_s + tokens * self._send_token_s, 0.0) \
            if isinstance(tokens, np.ndarray) else (self.link.latency_s + tokens * self._send_token_s if tokens > 0 else 0.0)

    def micro_batches(self, num_seqs):
        """m = min(pp, sequences), at least 1."""
        if isinstance(num_seqs, np.ndarray):
            return np.clip(num_seqs.astype(np.float64), 1.0, float(self.pp))
        return float(min(max(num_seqs, 1), self.pp))

    def _round(self, micro, m, tokens):
        send = self.send_seconds(tokens / m)
        path = micro + (self.pp - 1) * send
        busiest = m * (self.bottleneck_share * micro + send)
        return np.maximum(path, busiest) if isinstance(path, np.ndarray) else max(path, busiest)

    def predict(self, shape):
        m = self.micro_batches(shape.num_seqs)
        micro = super().predict(_scaled(shape, m))
        tokens = shape.num_prefill_tokens + shape.num_decode_tokens
        out = self._round(micro, m, tokens)
        return float(out) if np.ndim(out) == 0 else out

    def round_seconds(self, batches: list) -> float:
        """The round of in-flight batches of the given shapes (BatchShapes; empty ones skipped) cycling through
        the stages: max(the longest batch's path, the busiest stage's work on all of them). With m equal
        batches it is `predict` of their sum."""
        path = busy = 0.0
        for shape in batches:
            if not shape.num_seqs:
                continue
            t = CostModel.predict(self, shape)
            send = self.send_seconds(float(shape.num_prefill_tokens) + float(shape.num_decode_tokens))
            path = max(path, t + (self.pp - 1) * send)
            busy += self.bottleneck_share * t + send
        return max(path, busy)

    def round_decode_run(self, batches: list) -> np.ndarray:
        """`round_seconds` of each step of a run of pure-decode steps, its batches given as (sequences, KV tokens
        read, block-table entries) int arrays per batch in the executor's order, bit for bit (the same float
        operations in the same order; an empty batch adds exact zeros)."""
        path = busy = None
        for seqs, kv_read, entries in batches:
            t = CostModel.predict_decode(self, seqs, kv_read, entries)
            send = self.send_seconds(seqs.astype(np.float64))
            ran = seqs > 0
            p = np.where(ran, t + (self.pp - 1) * send, 0.0)
            b = np.where(ran, self.bottleneck_share * t + send, 0.0)
            path = p if path is None else np.maximum(path, p)
            busy = b if busy is None else busy + b
        return np.maximum(path, busy)

    def predict_decode(self, num_seqs, kv_tokens_read, block_table_entries, kv_tokens_padded=None):
        seqs = np.asarray(num_seqs, dtype=np.float64)
        m = self.micro_batches(seqs)
        padded = None if kv_tokens_padded is None else np.asarray(kv_tokens_padded, dtype=np.float64) / m
        micro = super().predict_decode(seqs / m, np.asarray(kv_tokens_read, dtype=np.float64) / m,
                                       np.asarray(block_table_entries, dtype=np.float64) / m, padded)
        return self._round(micro, m, seqs)

    def decode_prices(self, seqs, kv_read, entries):
        return None                  # the numpy path (predict_decode) prices a PP replica's runs

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f", pp={self.pp})"


@dataclass(frozen=True)
class RankStep:
    """What one DP rank's step asks of the MoE layers: its tokens (prefill + decode)."""
    tokens: float


class DPAttentionPricing:
    """The synchronised step of D attention ranks whose MoE layers run over all D x TP GPUs
    (module docstring). `cost` is a rank's cost model (TP GPUs, the whole model on its own batch); the
    MoE part of the step is re-priced for the group:

        rank time  = max(cost(own batch) - moe(own tokens at TP), 0)
                     + moe(all ranks' tokens over D x TP GPUs)
                     + all-to-all(the largest rank's tokens)
        step       = max over ranks (idle ranks: moe and all-to-all only, their dummy batch)

    moe(T over G GPUs) = layers_moe x max(T x top_k x expert FLOPs / G / peak / eff(T),
                                          distinct experts of T x expert bytes / G / bandwidth / eff)
    all-to-all(T) = MoE layers x 2 x top_k x hidden x act bytes x T / TP
                    x max((node - 1) / G / GPU link, (G - node) / G / network link)
                    + 2 x MoE layers x link latency        (node = min(G, GPUS_PER_NODE))
    With `free_all_to_all` the all-to-all costs nothing (the check that D ranks then match D engines)."""

    def __init__(self, cost: CostModel, dp: int, *, free_all_to_all: bool = False):
        m = cost.model
        if not m.is_moe:
            raise ParallelismError(f"data-parallel attention: {m.name} has no experts (a dense model's DP ranks "
                                   "are replicas: --replicas)")
        self.cost, self.dp = cost, dp
        tp = cost.tp
        self.gpus = dp * tp
        if m.num_experts < self.gpus:
            raise ParallelismError(f"dp (--data-parallel-size) {dp}: {m.num_experts} experts of "
                                   f"{m.name} over dp {dp} x tp {tp} = {self.gpus} GPUs leaves GPUs without an "
                                   "expert; expected experts >= dp x tp")
        p, g = cost.profile, cost.gpu
        peak = g.peak_flops(m.weight_dtype)
        # one routed expert's FLOPs per token and bytes, per GPU at a split of G GPUs
        self._expert_flop_s = m.num_moe_layers * 2 * m.expert_params / peak
        self._expert_byte_s = m.num_moe_layers * m.expert_bytes / g.mem_bw
        self._mfu = p.mfu_prefill if p.gemm_efficiency is None else None
        self._bw_eff = p.mem_bw_eff
        act = DTYPE_BYTES[m.activation_dtype]
        self.link = group_link(g, self.gpus)
        self.free_all_to_all = free_all_to_all
        # bytes one GPU sends per token of its rank: every MoE layer, dispatch + combine of top_k hidden rows;
        # (G - 1) / G of them leave the GPU: within the node over its interconnect, beyond it over the network
        # (the two at once: the slower share sets the time)
        per_token = m.num_moe_layers * 2 * m.experts_per_token * m.hidden_size * act / tp
        node = min(self.gpus, GPUS_PER_NODE)
        within = per_token * (node - 1) / self.gpus / g.link_bw
        across = per_token * (self.gpus - node) / self.gpus / self.link.bytes_per_s if self.gpus > node else 0.0
        self._a2a_token_s = max(within, across)
        self._a2a_latency_s = 2 * m.num_moe_layers * self.link.latency_s

    def _eff(self, rows: float) -> float:
        if self._mfu is not None:
            return self._mfu
        return float(self.cost.gemm_efficiency(max(rows, 1.0)))

    def moe_seconds(self, tokens: float, gpus: int) -> float:
        """The routed experts' time of a step of `tokens` tokens on one of `gpus` GPUs holding experts / gpus
        each: roofline of their FLOPs and the distinct experts read."""
        if tokens <= 0:
            return 0.0
        m = self.cost.model
        pairs = tokens * m.experts_per_token
        compute = pairs * self._expert_flop_s / gpus / self._eff(tokens)     # the cost model's efficiency by tokens
        memory = float(expected_distinct_experts(m.num_experts, m.experts_per_token, tokens)) * self._expert_byte_s \
            / gpus / self._bw_eff
        return max(compute, memory)

    def all_to_all_seconds(self, tokens: float) -> float:
        if self.free_all_to_all or self.gpus == 1:
            return 0.0
        return tokens * self._a2a_token_s + self._a2a_latency_s

    def step_seconds(self, own: list[float], tokens: list[float]) -> float:
        """The synchronised step: `own[r]` is rank r's step time from its cost model (None: idle, a dummy
        batch), `tokens[r]` its tokens."""
        total = float(sum(tokens))
        moe_group = self.moe_seconds(total, self.gpus)
        a2a = self.all_to_all_seconds(max(tokens) if tokens else 0.0)
        tp = self.cost.tp
        slowest = 0.0
        for t_r, n in zip(own, tokens, strict=True):
            rank = (0.0 if t_r is None else max(t_r - self.moe_seconds(n, tp), 0.0)) + moe_group + a2a
            slowest = max(slowest, rank)
        return slowest
