"""The names of the KV registries, without importing them: what an option's help lists (`--policy`,
`--slot-strategy`) at start-up, where the registries themselves would import numpy and every policy module
(~0.15 s of CPU, issue 49's start-up target; bench/bench_startup.py).

BUILTIN_POLICIES is a copy of the names the built-in policy modules register (sim/kv/policies/); the test
tests/test_cli_startup.py fails when it and the real registry differ. Plug-ins (entry points of
`kvsim.policies`, modules in $KVSIM_PLUGINS, policies registered in this process) are only known by
importing them: where there may be any (`may_have_plugins`), the CLI's help asks the real registry
(kvsim.sim.cli.options)."""
from __future__ import annotations

import functools
import os
import sys
from typing import Any

BUILTIN_POLICIES = ("ada_snapkv", "h2o", "kvcompress", "leankv", "none", "pyramidkv", "quest", "recorded", "snapkv",
                    "streaming", "tokenselect")
SLOT_STRATEGIES = ("noop", "free_block", "slot_reuse", "sparse_copy", "holed_copy", "compact", "parallel_compact")
PLUGIN_GROUP = "kvsim.policies"      # entry-point group of installed policy plug-ins
PLUGIN_ENV = "KVSIM_PLUGINS"         # comma-separated modules to import (registering policies)
_REGISTRY_MODULE = __name__.rpartition(".")[0] + ".policy"      # kvsim.sim.kv.policy (not imported here)


def may_have_plugins() -> bool:
    """Whether a policy outside the built-in ones may be registered: $KVSIM_PLUGINS names a module, an
    installed package declares a `kvsim.policies` entry point, or this process already imported the
    registry (where code may have called @register_policy itself)."""
    return _REGISTRY_MODULE in sys.modules or bool(os.environ.get(PLUGIN_ENV, "").strip(" ,")) \
        or bool(plugin_entry_points())


@functools.cache
def plugin_entry_points() -> tuple[Any, ...]:
    """The installed `kvsim.policies` entry points, read once a process (each read scans every installed
    distribution's metadata, ~5-10 ms; the help and the registry both ask)."""
    from importlib.metadata import entry_points

    return tuple(entry_points(group=PLUGIN_GROUP))

