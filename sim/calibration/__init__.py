"""Calibration: fit the simulator's models to measurements of the real backend.

Modules (`kvsim calibrate` is their command line):

- `step_logs`: read measured step logs (`load_step_logs`: replay directories, bare steps.parquet files,
  medians of repeated replays; padded-attention counts recomputed by a recorded simulation);
- `profile_fit`: fit a hardware profile's efficiency factors and overheads to those step times
  (`fit_profile`, `profile_meta`);
- `importance_fit`: fit the synthetic importance model to measured per-head attention statistics
  (`load_attention_stats`, `fit_importance`);
- `correlation_fit`: fit that model's content correlation to recorded evictions (`fit_content_correlation`);
- `attention_profile`: where per-step H2O's evictions fall on real SmolLM2 attention vs the importance
  model, and TokenSelect's Selection Cache reuse rate on real decode queries;
- `regenerate_cpu_profile`: the procedure that regenerates the shipped CPU profile and importance model.

The package builds on `kvsim.sim.crosscheck` (step shapes and kinds, error figures, recorded simulation);
the cross-check never imports it.
"""
