"""Built-in KV policies; importing this package registers them (see sim.kv.policy)."""
from importlib import import_module

_BUILTIN = ("none", "streaming", "h2o", "snapkv", "pyramidkv", "ada_snapkv", "kvcompress", "leankv", "quest",
            "recorded")

for _name in _BUILTIN:
    try:
        import_module(f"{__name__}.{_name}")
    except ModuleNotFoundError as exc:          # a policy module not written yet
        if exc.name != f"{__name__}.{_name}":
            raise
