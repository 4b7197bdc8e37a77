"""KV connectors (sim.core.connector.KVConnector implementations), one module each:

- `remote_store`: a prompt's KV loaded from a store shared by replicas (LMCache's remote backend,
  Mooncake's pool) after a priced delay; saved there when a request finishes.
- `offload`: vLLM's OffloadingConnector: a CPU tier per replica (sim/cluster/tiers.py) over its PCIe
  link; full prompt blocks stored asynchronously after the step that filled them, prefix hits beyond
  the GPU's loaded asynchronously (docs/kv-tiers.md).
- `disaggregation`: vLLM's prefill/decode hand-off (NIXL): the prefill side keeps a finished prefill's
  blocks until the decode side has pulled them; the decode side waits in WAITING_FOR_REMOTE_KVS.
"""
