"""Built-in KV policies; importing this package registers them (see sim.kv.policy)."""
from importlib import import_module

_BUILTIN = ("none", "streaming", "h2o", "snapkv", "pyramidkv", "ada_snapkv", "kvcompress", "leankv", "quest",
            "recorded")

for _name in _BUILTIN:
    import_module(f"{__name__}.{_name}")
