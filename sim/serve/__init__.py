"""`kvsim serve`: an OpenAI-compatible HTTP server in front of kvsim's simulated engine (interface layer).

The engine is the one `kvsim simulate` runs (sim.engine.resolved_run.resolve_run, sim.engine.assembly.build_engine,
the simulator's executor); `live.LiveEngine` advances its simpy clock in step with the wall clock and
feeds it the requests that reach the server; `app` speaks OpenAI's API (server-sent events for
streaming) and vLLM's Prometheus metrics (`metrics`). See docs/serve.md.
"""
