"""A run's speculative config resolved once (`resolve_spec`): the scheduler's settings, the drafter's
cost per step and the HBM its weights and KV take from the target's KV pool.

Costs reuse the cost model (sim/model/cost_model.py), never a copy of it:

- the target's verification step is priced by the target's `CostModel` on the step's `BatchShape`
  (sim/core/step.py counts 1 + drafts query tokens per verified sequence: linear compute and the
  attention's query-key pairs grow, weight and KV reads do not);
- EAGLE / EAGLE-3 / MTP: a head of one decoder layer of the target's shape (EAGLE-3: its LM head over
  the drafter's reduced vocabulary) priced by a `CostModel` of that one-layer spec; draft model: the
  draft model's own `CostModel` at its TP. As vLLM's EAGLE-style proposers run them: a first pass over
  every token the step computed (the drafter keeps its own KV for them), then k - 1 passes of one token
  for each request that drafts. Only the device time counts (the engine step's CPU overhead is the
  target's, once): the drafter's cost models run under the target's profile with the per-step, per-
  sequence and block-table overheads set to zero;
- n-gram: a host-side lookup, a fixed time per step and per drafting request (sim/data/spec_decode.yaml).

What vLLM's spec-decode path does beyond those forwards (`LoopCosts`, counts and sources in
sim/data/spec_decode.yaml `vllm_loop`), priced from shapes with the target's profile:

- the rejection sampler (vllm/v1/sample/rejection_sampler.py): greedy verification takes the argmax of
  the target's logits at every draft position (a read of vocab x 4 bytes per position) and runs a few
  small kernels (output buffer fill, argmax, `rejection_greedy_sample_kernel`);
- the drafting loop (vllm/v1/spec_decode/eagle.py `propose`): between the k - 1 one-token passes the
  inputs, positions, sequence lengths and slot mapping are updated by small eager kernels and each pass
  ends with an argmax (EAGLE-3: plus the draft-to-target vocabulary mapping); each small kernel costs the
  profile's fixed kernel time (`gemm_latency_s`, a lower bound for a launch-bound kernel);
- weights the one-layer head's cost model leaves out: EAGLE's and MTP's fusion projection (2h x h, every
  pass), EAGLE-3's projection of the three auxiliary hidden states (3h x h, first pass) and its wider QKV
  projection (input [embedding, hidden], 2h wide: h x (q + 2 kv) more, every pass).
"""
from __future__ import annotations

from copy import copy
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import yaml

from ..core.spec_decode import SpecDecodeSettings
from ..core.step import BatchShape
from .catalog import DTYPE_BYTES, GPUSpec, ModelSpec, get_model
from .cost_model import CostModel, HardwareProfile, kv_heads_per_gpu

if TYPE_CHECKING:
    from ..config import SpeculativeConfig

DATA = Path(__file__).parent.parent / "data" / "spec_decode.yaml"
GiB = 2**30


class SpecConfigError(ValueError):
    """A speculative config kvsim cannot run (one line naming the key)."""


def spec_data() -> dict[str, Any]:
    with open(DATA) as f:
        return yaml.safe_load(f)


def conditional_from_rates(rates: list[float], k: int, decay: float) -> tuple[float, ...]:
    """Per-position acceptance rates (P(drafts 0..i accepted)) -> k conditional probabilities; past the
    given positions the last conditional probability times `decay` per position."""
    cond, prev = [], 1.0
    for r in rates[:k]:
        cond.append(r / prev if prev > 0 else 0.0)
        prev = r
    last = cond[-1] if cond else 0.0
    while len(cond) < k:
        last = min(1.0, last * decay)
        cond.append(last)
    return tuple(cond)


@dataclass(frozen=True)
class LoopCosts:
    """vLLM's spec-decode work beyond the drafter's forwards (see the module docstring): seconds per small
    kernel, kernel counts, extra weight reads and the rejection sampler's logits read."""
    kernel_s: float = 0.0               # one small eager kernel (the profile's fixed kernel time)
    pass_kernels: int = 0               # small kernels around each one-token drafting pass
    first_pass_kernels: int = 0         # small kernels around the first pass (inputs shifted, argmax)
    row_s: float = 0.0                  # seconds per drafting sequence and pass: its logits' argmax read
                                        # (EAGLE-3: also the scatter into a -inf target-vocabulary row)
    pass_params: float = 0.0            # weights each drafting forward reads beyond the head's cost model
    first_pass_params: float = 0.0      # weights only the first forward reads (EAGLE-3's 3h x h projection)
    param_byte_s: float = 0.0           # seconds per weight read (weight bytes / (bandwidth x efficiency))
    param_flop_s: float = 0.0           # seconds per weight x token (2 flops at the peak)
    sampler_kernels: int = 0            # the rejection sampler's small kernels per verification step
    sampler_row_s: float = 0.0          # seconds to read one draft position's target logits (argmax)

    def linear_s(self, params: float, tokens: float, efficiency: float) -> float:
        """Extra weights `params` applied to `tokens` tokens: read once, or computed, whichever binds."""
        if params <= 0.0:
            return 0.0
        read = params * self.param_byte_s
        compute = params * tokens * self.param_flop_s / efficiency
        return read if read >= compute else compute

    def sampler_seconds(self, draft_tokens: int) -> float:
        """The rejection sampler's device time in a step verifying `draft_tokens` drafts (0: none)."""
        if draft_tokens <= 0:
            return 0.0
        return self.sampler_kernels * self.kernel_s + draft_tokens * self.sampler_row_s


def _without_logit_rows(shape: BatchShape) -> BatchShape:
    """`shape` with logits for one row per sequence (the drafter's first pass): a copy, as `replace` makes
    it, without `replace`'s cost per call (BatchShape has no __post_init__)."""
    out = copy(shape)
    out.num_logit_rows = None
    return out


def _linear_run(loop: LoopCosts, params: float, tokens: np.ndarray, efficiency) -> np.ndarray | float:
    """`LoopCosts.linear_s` element by element over a run's steps."""
    if params <= 0.0:
        return 0.0
    read = params * loop.param_byte_s
    compute = params * tokens * loop.param_flop_s / efficiency
    return np.where(read >= compute, read, compute)


@dataclass(frozen=True)
class DraftCost:
    """Seconds the drafter adds to a step (see the module docstring)."""
    method: str
    k: int
    cost: CostModel | None              # the head's / draft model's cost model (None: n-gram)
    host_per_step_s: float = 0.0
    host_per_request_s: float = 0.0
    loop: LoopCosts = LoopCosts()
    # m -> the loop's seconds per one-token pass; (m, tokens) -> the first pass's (see seconds_flat)
    _memo: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def flat(self) -> bool:
        """Whether `seconds_flat` prices this drafter (n-gram, or a cost model with the operator form)."""
        return self.cost is None or self.cost.profile.operator_form

    def seconds_flat(self, seqs: int, tokens: int, pairs: float, kv_read: float, entries: int, m: int,
                     kv: int) -> float:
        """`seconds_of` of a step without copies, swaps or KV-policy work given as numbers (the step's
        sequences, query tokens, prefill pairs, KV tokens read and block-table entries), bit for bit: each
        forward priced by `CostModel.flat_step_total` (the first pass over the step's tokens with one logit
        row per sequence, then k - 1 one-token passes), the loop's terms that depend on m (and the step's
        tokens) alone memoised, added in `seconds_of`'s order. Needs `flat`."""
        if not m:
            return 0.0
        if self.cost is None:
            return self.host_per_step_s + m * self.host_per_request_s
        flat = self.cost.flat_step_total
        memo = self._memo
        first = memo.get((m, tokens))
        if first is None:
            loop = self.loop
            t = float(tokens)
            first = memo[(m, tokens)] = (loop.first_pass_kernels * loop.kernel_s + m * loop.row_s
                                         + loop.linear_s(loop.pass_params + loop.first_pass_params, t,
                                                         self._efficiency(t)))
        total = flat(seqs, seqs, tokens, pairs, kv_read, entries) + first
        if self.k > 1:
            per_pass = memo.get(m)
            if per_pass is None:
                loop = self.loop
                per_pass = memo[m] = (loop.pass_kernels * loop.kernel_s + m * loop.row_s
                                      + loop.linear_s(loop.pass_params, m, self._efficiency(m)))
            total = self.cost.flat_passes(total, m, kv, self.k - 1, per_pass)
        return total

    def seconds(self, shape: BatchShape, contexts: list[float]) -> float:
        """The drafter's time in a step of `shape` whose requests in `contexts` (their KV tokens after
        the step) draft k tokens each."""
        return self.seconds_of(shape, len(contexts), sum(contexts))

    def seconds_of(self, shape: BatchShape, m: int, kv: float) -> float:
        """`seconds` given the number of drafting requests `m` and the sum of their contexts `kv`."""
        if not m:
            return 0.0
        if self.cost is None:
            return self.host_per_step_s + m * self.host_per_request_s
        # first pass: the step's tokens, logits for one position per sequence (each request's last accepted)
        total = float(self.cost.predict(_without_logit_rows(shape)))
        loop = self.loop
        tokens = float(shape.num_prefill_tokens) + float(shape.num_decode_tokens)
        eff = self._efficiency
        total += (loop.first_pass_kernels * loop.kernel_s + m * loop.row_s
                  + loop.linear_s(loop.pass_params + loop.first_pass_params, tokens, eff(tokens)))
        per_pass = loop.pass_kernels * loop.kernel_s + m * loop.row_s + loop.linear_s(loop.pass_params, m, eff(m))
        for j in range(1, self.k):
            total += float(self.cost.predict(BatchShape(num_seqs=m, num_decode_tokens=m, kv_tokens_read=kv + m * j)))
            total += per_pass
        return total

    def seconds_run(self, shape: BatchShape, m: np.ndarray, kv: np.ndarray) -> np.ndarray:
        """`seconds` for each step of a run (float64 or int64 arrays; sim/engine/bulk/spec_runs.py): `shape`'s
        fields are arrays over the steps, `m` the requests that draft in each step (all > 0) and `kv` the
        sum of their contexts. The same operations in the same order, element by element: bit-identical
        to `seconds` step by step (tested)."""
        if self.cost is None:
            return self.host_per_step_s + m * self.host_per_request_s
        total = self.cost.predict(replace(shape, num_logit_rows=None))
        loop = self.loop
        tokens = np.asarray(shape.num_prefill_tokens, np.float64) + np.asarray(shape.num_decode_tokens, np.float64)
        eff = self._efficiency_run
        total = total + (loop.first_pass_kernels * loop.kernel_s + m * loop.row_s
                         + _linear_run(loop, loop.pass_params + loop.first_pass_params, tokens, eff(tokens)))
        per_pass = loop.pass_kernels * loop.kernel_s + m * loop.row_s + _linear_run(loop, loop.pass_params, m, eff(m))
        for j in range(1, self.k):
            total = total + self.cost.predict(BatchShape(num_seqs=m, num_decode_tokens=m, kv_tokens_read=kv + m * j))
            total = total + per_pass
        return total

    def _efficiency_run(self, tokens: np.ndarray) -> np.ndarray | float:
        assert self.cost is not None
        if self.cost.profile.operator_form:
            return self.cost.gemm_efficiency(tokens)
        return float(self.cost.profile.mfu_decode)

    def _efficiency(self, tokens: float) -> float:
        """The drafter's matmul efficiency at `tokens` rows (the profile's table, else mfu_decode)."""
        assert self.cost is not None
        if self.cost.profile.operator_form:
            return float(self.cost.gemm_efficiency(tokens))
        return float(self.cost.profile.mfu_decode)


@dataclass(frozen=True)
class ResolvedSpec:
    """A speculative config resolved for one model, GPU and TP."""
    method: str
    model: str | None                   # the draft model / head named in the config
    settings: SpecDecodeSettings
    draft: DraftCost
    weight_bytes: int                   # the drafter's weights on each GPU
    kv_bytes_per_token: float           # the drafter's KV per token on each GPU (in the target's blocks)
    source: str                         # where the acceptance came from

    def conditional_for(self, rates: tuple[float, ...] | list[float]) -> tuple[float, ...]:
        """k conditional probabilities from measured per-position rates (a workload class's): as
        `synthetic_acceptance_rates`, the last conditional probability holds past the given positions."""
        return conditional_from_rates(list(rates), self.settings.num_speculative_tokens, 1.0)

    def describe(self) -> dict:
        s = self.settings
        return {"method": self.method, "model": self.model, "num_speculative_tokens": s.num_speculative_tokens,
                "num_lookahead_tokens": s.num_lookahead_tokens,
                "conditional_acceptance": [round(c, 6) for c in s.conditional],
                "expected_acceptance_rate_per_pos": [round(c, 6) for c in s.per_position],
                "expected_mean_acceptance_length": round(s.mean_acceptance_length, 6),
                "propose_rate": s.propose_rate, "acceptance_source": self.source,
                "drafter_weight_gib_per_gpu": round(self.weight_bytes / GiB, 4),
                "drafter_kv_bytes_per_token_per_gpu": self.kv_bytes_per_token}


def _drafter_profile(profile: HardwareProfile) -> HardwareProfile:
    """The target's profile without the engine step's CPU overheads (charged once, by the target)."""
    return profile.model_copy(update={"step_overhead_s": 0.0, "per_seq_overhead_s": 0.0,
                                      "per_block_entry_overhead_s": 0.0})


def resolve_spec(spec: SpeculativeConfig, target: ModelSpec, gpu: GPUSpec, tp: int,
                 target_cost: CostModel) -> ResolvedSpec:
    """Resolve `spec` for `target` on `gpu` x `tp`: refuses, in one line naming the key, what vLLM
    refuses or kvsim cannot price (a draft model of another vocabulary or larger than the GPU, MTP on a
    model without MTP modules, a drafter TP other than 1 or the target's)."""
    data = spec_data()
    if spec.method is None:
        raise SpecConfigError("speculative_config: give method (ngram, eagle, eagle3, mtp, draft_model) or model "
                              "(vLLM: 'num_speculative_tokens was provided but without speculative model')")
    method = spec.method
    k = spec.num_speculative_tokens
    if method == "mtp":
        modules = data["mtp_models"].get(target.name)
        if modules is None:
            raise SpecConfigError(f"speculative_config.method: mtp needs a model with multi-token-prediction modules "
                                  f"({', '.join(data['mtp_models'])}); {target.name} has none")
        k = k if k is not None else modules          # vLLM: n_predict from the model's config
    if k is None:
        raise SpecConfigError("speculative_config.num_speculative_tokens: expected an integer > 0 (vLLM needs it "
                              "unless the drafter's config gives n_predict)")
    draft_tp = spec.draft_tensor_parallel_size or tp
    if draft_tp not in (1, tp):
        raise SpecConfigError(f"speculative_config.draft_tensor_parallel_size: expected 1 or the target's TP "
                              f"({tp}), got {draft_tp}")
    entry = data["methods"][method]
    # a published acceptance for this method's drafter of this very target replaces the method's default
    entry = {**entry, **entry.get("models", {}).get(target.name, {})}
    rates = spec.synthetic_acceptance_rates
    source = "speculative_config.synthetic_acceptance_rates" if rates is not None else entry["source"]
    cond = conditional_from_rates(list(rates if rates is not None else entry["per_position"]), k,
                                  1.0 if rates is not None else float(entry["decay"]))
    propose = 1.0 if rates is not None else float(entry.get("propose_rate", 1.0))
    profile = _drafter_profile(target_cost.profile)
    w_bytes = DTYPE_BYTES[target.weight_dtype]
    lookahead = 0
    counts = data["vllm_loop"]
    bw = gpu.mem_bw * target_cost.profile.mem_bw_eff
    base_loop = LoopCosts(kernel_s=float(target_cost.profile.gemm_latency_s),
                          sampler_kernels=int(counts["sampler_kernels"]),
                          sampler_row_s=4.0 * target.vocab_size / bw)     # fp32 logits, every rank (gathered)
    if method == "ngram":
        host = data["ngram_host_s"]
        draft = DraftCost(method, k, None, float(host["per_step"]), float(host["per_request"]), loop=base_loop)
        weights, kv_per_token = 0, 0.0
    elif method == "draft_model":
        draft_model = get_model(spec.model)
        if draft_model.vocab_size != target.vocab_size:
            raise SpecConfigError(f"speculative_config.model: {draft_model.name} has a vocabulary of "
                                  f"{draft_model.vocab_size} tokens, {target.name} {target.vocab_size}; vLLM needs the same")
        weights = draft_model.weight_bytes // draft_tp
        if weights >= gpu.memory_bytes:
            raise SpecConfigError(f"speculative_config.model: {draft_model.name} needs {weights / GiB:.1f} GiB of weights "
                                  f"per GPU (draft TP {draft_tp}) but {gpu.name} has {gpu.memory_gib:g} GiB; expected a "
                                  "smaller draft model or a larger draft_tensor_parallel_size")
        kv_per_token = (draft_model.kv_bytes_per_token() * kv_heads_per_gpu(draft_model, draft_tp)
                        / draft_model.num_kv_heads)
        draft = DraftCost(method, k, CostModel(draft_model, gpu, profile, tp=draft_tp),
                          loop=replace(base_loop, pass_kernels=int(counts["pass_kernels"]),
                                       first_pass_kernels=int(counts["first_pass_kernels"]),
                                       row_s=4.0 * draft_model.vocab_size / bw))
        lookahead = k
    else:                                   # eagle, eagle3, mtp: one decoder layer of the target's shape
        vocab = int(data["eagle3_draft_vocab"]) if method == "eagle3" else target.vocab_size
        head = target.model_copy(update={"name": f"{target.name}-{method}-head", "num_layers": 1,
                                         "vocab_size": vocab, "sliding_window": None,
                                         "sliding_window_layers": None})
        h = target.hidden_size
        fc_inputs = {"eagle3": 3, "eagle": 2, "mtp": 2}[method]       # the fused hidden states' projection
        fc = fc_inputs * h * h
        # EAGLE-3's layer takes [embedding, hidden] (2h) into its QKV projection: h x (q + 2 kv) more
        wide_qkv = h * (target.q_size + 2 * target.kv_size) if method == "eagle3" else 0
        extra = fc + wide_qkv
        if method == "eagle3":
            extra += vocab * h                               # its own LM head over the draft vocabulary
        weights = int((target.linear_params_per_layer + extra) * w_bytes) // draft_tp
        if weights >= gpu.memory_bytes:
            raise SpecConfigError(f"speculative_config: the {method} head needs {weights / GiB:.1f} GiB per GPU but "
                                  f"{gpu.name} has {gpu.memory_gib:g} GiB")
        kv_per_token = target.kv_bytes_per_token() / target.num_layers * kv_heads_per_gpu(target, draft_tp) \
            / target.num_kv_heads
        # EAGLE and MTP fuse [embedding, hidden] through their projection in every forward; EAGLE-3
        # projects the target's three auxiliary hidden states once (first pass) and widens its QKV
        vocab_map = int(counts["eagle3_vocab_map_kernels"]) if method == "eagle3" else 0
        # per sequence and pass: the argmax reads a row of fp32 logits; EAGLE-3's compute_logits first fills a
        # -inf row of the target's vocabulary and scatters its draft-vocabulary logits into it
        row_bytes = (4.0 * (2 * target.vocab_size + 2 * vocab) if method == "eagle3" else 4.0 * vocab)
        loop = replace(base_loop, pass_kernels=int(counts["pass_kernels"]) + vocab_map,
                       first_pass_kernels=int(counts["first_pass_kernels"]) + vocab_map,
                       row_s=row_bytes / bw,
                       pass_params=float(wide_qkv if method == "eagle3" else fc),
                       first_pass_params=float(fc if method == "eagle3" else 0),
                       param_byte_s=w_bytes / bw / draft_tp,
                       param_flop_s=2.0 / gpu.peak_flops(target.weight_dtype) / draft_tp)
        draft = DraftCost(method, k, CostModel(head, gpu, profile, tp=draft_tp), loop=loop)
        lookahead = k                       # vLLM: num_lookahead_tokens = k for EAGLE-style drafters
    settings = SpecDecodeSettings(num_speculative_tokens=k, num_lookahead_tokens=lookahead, conditional=cond,
                                  propose_rate=propose)
    return ResolvedSpec(method, spec.model, settings, draft, int(weights), float(kv_per_token), source)
