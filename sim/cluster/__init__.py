"""The cluster layer: engine replicas grouped in pools, the links between them, KV connectors that
move KV cache over those links, and each request's route through the fleet.

Above the engine (sim.engine: one replica's loop), below the drivers (simulate, replay) that build
a run from it. A single pool of identical replicas behind a router is today's run
(sim.engine.assembly.build_engine); a fleet of several pools (prefill and decode pools, pools of other
GPUs) is built by `sim.cluster.fleet.build_fleet`. The core knows the connector only through
`sim.core.connector.KVConnector`.
"""
