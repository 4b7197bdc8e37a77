"""Built-in KV policies, one module each; importing this package registers every module in it (see sim.kv.policy)."""
from importlib import import_module
from pkgutil import iter_modules

for _module in iter_modules(__path__):
    import_module(f"{__name__}.{_module.name}")
