"""KV connectors (sim.core.connector.KVConnector implementations), one module each:

- `remote_store`: a prompt's KV loaded from a store shared by replicas (LMCache's remote backend,
  Mooncake's pool) after a priced delay; saved there when a request finishes.
- `disaggregation`: vLLM's prefill/decode hand-off (NIXL): the prefill side keeps a finished prefill's
  blocks until the decode side has pulled them; the decode side waits in WAITING_FOR_REMOTE_KVS.
"""
