"""KV memory with eviction, compression and fragmentation: layouts, slot state, slot strategies,
eviction-aware managers, policies (plug-ins, see `sim.kv.policy`), importance model, fast mode."""
