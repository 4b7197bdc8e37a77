"""kvsim serve's live engine (sim/serve/live.py) on the wall clock produces exactly `kvsim simulate`'s token
times on the arrivals it recorded: the same engine, fed as requests come, with decode fast-forward on (a
lower bound of the next arrival keeps it exact) or off. The run is real time at --time-scale 10 on a
loaded machine, so the engine also lags at times (it then catches up in bulk, still exactly)."""
from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest

from kvsim.sim.config import load_config
from kvsim.sim.engine.resolved_run import resolve_run
from kvsim.sim.serve.live import LiveEngine, SimClock, TraceRecorder
from kvsim.sim.serve.metrics import RequestMetrics
from kvsim.sim.serve.protocol import Generation
from kvsim.sim.simulator.simulate import run_simulation

SYSTEM = list(range(1000, 1000 + 300))       # a shared system prompt: prefix-cache hits


def _prompts(n: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        own = [rng.randrange(5, 40000) for _ in range(rng.randrange(20, 900))]
        out.append(((SYSTEM if i % 2 else []) + own, rng.randrange(4, 60)))
    return out


async def _serve(plan, trace_path, requests, rate_per_s: float, time_scale: float):
    engine = LiveEngine(plan, SimClock(time_scale), RequestMetrics("m", plan.max_model_len, plan.cfg.replicas),
                        asyncio.get_running_loop(), TraceRecorder(trace_path, plan.cfg.engine.block_size))
    served: dict[int, list[float]] = {}
    engine.on_finished = lambda req: served.__setitem__(req.request_id, list(req.token_times))
    streamed: dict[int, int] = {}

    async def consume(live):
        async for start, end in engine.tokens(live):
            assert start == streamed.get(live.request.request_id, 0)
            streamed[live.request.request_id] = end

    rng = np.random.default_rng(7)
    tasks = []
    for ids, out in requests:
        await asyncio.sleep(rng.exponential(1.0 / rate_per_s) / time_scale)
        live = engine.submit(Generation(ids, out, out, "length", True, False, False))
        tasks.append(asyncio.create_task(consume(live)))
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=300)     # a stalled engine fails, not hangs
    engine.close()
    return served, streamed, engine


@pytest.mark.parametrize("fast_forward", [True, False])
def test_served_token_times_equal_simulate_on_the_recorded_arrivals(tmp_path, fast_forward):
    # a small KV pool: requests queue, batch, hit the shared prefix and get preempted
    cfg = load_config(None, {"fast_forward": fast_forward, "engine.num_gpu_blocks": 100, "replicas": 1})
    plan = resolve_run(cfg)
    requests = _prompts(40, seed=3)
    trace = tmp_path / "served.jsonl"
    served, streamed, engine = asyncio.run(_serve(plan, trace, requests, rate_per_s=100.0, time_scale=10.0))
    assert len(served) == len(requests) and not engine.live
    assert all(streamed[i] == len(served[i]) == requests[i][1] for i in served)

    sim = run_simulation(cfg.model_copy(update={"trace": str(trace)}))
    print(sim.summary["preemptions"], sim.summary["prefix_hit_rate"])
    assert sim.summary["preemptions"] > 0 and sim.summary["prefix_hit_rate"] > 0
    df = sim.requests.set_index("request_id")
    for rid, times in served.items():
        assert list(df.loc[rid, "token_times_s"]) == times, f"request {rid}: served token times differ"


def test_two_replicas_behind_the_router_equal_simulate(tmp_path):
    cfg = load_config(None, {"replicas": 2, "router": "least_outstanding", "engine.num_gpu_blocks": 200})
    plan = resolve_run(cfg)
    requests = _prompts(24, seed=5)
    trace = tmp_path / "served.jsonl"
    served, _, _ = asyncio.run(_serve(plan, trace, requests, rate_per_s=60.0, time_scale=10.0))
    sim = run_simulation(cfg.model_copy(update={"trace": str(trace)}))
    df = sim.requests.set_index("request_id")
    assert set(df["replica"]) == {0, 1}
    for rid, times in served.items():
        assert list(df.loc[rid, "token_times_s"]) == times
