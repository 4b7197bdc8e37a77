"""Block-occupancy fast mode: page live-counts for all running requests in one slab, no token state.

For large traces. Every running request owns a slot of a slab of arrays; per (request, row = layer x
KV head) it keeps the live-token count of each page column (`occ [slots, rows, cols]`), how many of
those are still in the recent window (`win`), and — in a ring of `protect_recent` entries — the
page column of each window token, so the token leaving the window is located in O(1). No
attention is computed: a policy's `fast_mode_profile()` gives `budget` (tokens kept per row),
`protect_recent` (the newest tokens, never evicted), `protect_first` (the oldest, never evicted)
and `age_weight`, which says where evictions fall:

- "oldest" (StreamingLLM): the token leaving the window is evicted; the prompt cut keeps the newest
  candidates.
- "young" (H2O, ranking by accumulated attention): the simulated rows are a stratified sample (by
  head type, then local decay) of the importance model's rows for the run's seed (kv.importance:
  sink / local / heavy / spread heads in the model's mix, with their sink share s, local share l,
  decay tau and content concentration sigma), and each step evicts, per row, the candidate with
  the lowest accumulated attention, computed in closed form from the same model token-level mode
  scores with: token t holds l (d^(a0-t) - d^(q+1-t)) + (1-s-l) w_t (H(q) - H(a0-1)) after query q
  (d = exp(-1/tau); w_t = exp(sigma z) its content weight, drawn once; H = running sum of 1/Zw,
  Zw = the sum of all content weights so far; a0 = its first observed query). Per token only the
  static part, w_t and its decay term are stored (in the heavy list, or in a ring while in the
  window); the step is a compiled kernel (kernels.decode_rows, numpy twin in reference.py) that keeps a few
  candidates per row with an exact threshold and rescans a row's list only when they cannot hold
  the minimum. The prompt cut keeps each row's top candidates by the
  scores of the last `obs_window` prefill queries; the first NUM_SINK tokens (attention sinks) are
  never evicted. Nothing is fitted: local heads evict the oldest prompt remnants first (little local
  attention), spread heads mostly the token leaving the window, heavy/sink heads spread evictions
  over all ages, as measured per head type in token-level runs. The per-query renormalization over
  live tokens and the local normalizer's first tau steps are left out. Against token-level mode
  on four SmolLM2 closed-batch workloads (3-16 requests, prompts 48-300, outputs 80-300, budget 60)
  fragmentation and KV utilization agree within 2% for free_block and slot_reuse (global draws
  fitted on a grid: up to 9%).
- "uniform": every eviction is a uniformly drawn non-window token; the prompt cut keeps a uniformly
  random subset of the candidates (multivariate hypergeometric per row).

Per decode step the scheduler's `allocate_slots` (or `allocate_decodes` for the whole batch) only
reserves the pages precomputed for each request's next token (pure Python); `finish_step` then
applies the step to all decoding requests at once: one write, one window exit and one eviction per
row, plus the slot strategy (a page frees when its count reaches zero; reuse strategies fill the
first page with a hole; compaction moves the last page's tokens into the hole; sparse copy rewrites
the holed page and the tail), in one compiled kernel call (kernels.decode_rows) or, without
numba, as fancy-index updates of [requests, rows] arrays (`FastStep.step_numpy`, its twin). Rows in an
unusual state (several holed pages right after the prompt cut, several pages to compact) take an
exact count-based path over their page columns. Rows differ only by their head parameters (H2O),
so only `sample_rows` of them (a divisor of layers x KV heads, `kv.fast_rows`, default 8; stratified by head type) are simulated,
each standing for the same number of pool pages. `noop` never frees or moves a page, so where
evictions fall changes no metric: it tracks counts only (live tokens, pages, the tail's fill) in one
row standing for all, with no draws. Decode rows are stepped in slab order (their memory walk
ascends). Draws come from one numpy Generator seeded by the run's seed: same inputs, same results.
Validated against token-level mode in tests/test_kv_fast.py, kernels against their twins in
tests/test_kv_fast_kernels.py.

Prompt-cut policies (SnapKV with a rate, PyramidKV, Ada-KV, KV-Compress) give per-row cut budgets
(`budgets`), KV-Compress also compresses under memory pressure (`reclaim`), the SnapKV family's
decode-time compression re-runs the cut (`recut`); LeanKV (precision groups of different page capacities)
runs the token-level manager on a stratified sample of the rows (`sampled`, no slab); their models
and agreement are in docs/kv-policies.md section 5.

Modules, one component each (FastKVManager holds them; each is built from what it reads, see
manager.py): manager (FastKVManager, the scheduler-facing surface), settings (FastSettings: the run's
constants, resolved once), slab (FastSlab: the per-slot arrays, their growth, the scheduler's
mirrors; CountPool and Ledger: the pool and the step's plan), budgets (CutBudgets: per-row cut
budgets, their sharing, when a re-cut fires), scoring (Heads and Scorer: where evictions fall,
H2O's closed form, heavy lists, draws), slots (SlotStrategy on page counts), step (FastStep: the
prompt cut and the batched decode step), reclaim (Reclaim: compression under memory pressure), recut
(Recut: decode-time re-cuts), sampled (LeanKV: the token-level manager on sampled rows), layout (row
fields and the kernel's named argument groups), kernels (numba) and reference (their numpy twins).
"""

from .manager import FastKVManager
from .slab import CountPool

__all__ = ["FastKVManager", "CountPool"]
