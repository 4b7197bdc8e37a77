"""Cross-check: the simulator's prediction of a run against the real backend's replay of it.

Two simulations are compared with one replay (the same trace, engine and policy options):

- **predicted**: the simulator with a calibrated profile, advancing time by the cost model. Gives
  the latency and throughput errors (TTFT/TPOT/E2E percentiles, tokens/s). Per-step time error is
  measured on the replay's own steps (the same batch shapes): cost-model prediction vs measurement.
- **recorded**: the simulator advancing time by the replay's *measured* step durations (and, for
  eviction policies, fed the replay's recorded decisions when the policy supports it), so every
  step schedules the same batch. Memory metrics (blocks used/free, slots, fragmentation,
  preemptions, evictions) must then agree step by step; the report says so or shows the first
  divergence.

**Repeats.** One replay's step times scatter by 10-20% on a shared CPU. With N replays of the same
workload (the schedule is deterministic: same config, seed and workload; checked step by step on the
schedule and memory columns), each step's measured time is the median over the N replays, and the
measured latencies and throughput are those of the recorded simulation fed these medians: it
advances time by the same step durations as a replay, so with one replay it reproduces the replay's
request timings exactly (checked: `request_timings_identical`).

Modules (each imports only those above it; `kvsim.sim.calibration` builds on this package):

- `comparison`: the figures of a measured run against a prediction (`compare`, `Repeats`), and the
  step-log pieces the calibration shares (`shape_of_steps`, `step_kind`, `fit_errors`, `first_divergence`);
- `recorded`: the recorded-timing simulation of a replay (`simulate_recorded`, `replay_shape_columns`)
  and the predicted simulation's config (`predicted_config`);
- `report`: report.md / report.html / crosscheck.json (`write_report`).
"""
