"""Engine core: request, block pool, KV cache manager, scheduler, step shape and the KVManager/Executor protocols."""
