"""Multi-turn sessions (sim/engine/sessions.py, traces/sessions.py): a closed loop per session (a turn is
released when the previous answer finished plus its think time), each turn's prompt the conversation so
far whose blocks the prefix cache hits, the session_affinity router, the three sources (synthetic,
ShareGPT conversations, a generic log's session/turn columns) and their one-line refusals."""
import json

import numpy as np
import pandas as pd
import pytest

from kvsim.sim.config import ConfigError, load_config
from kvsim.sim.simulator.simulate import run_simulation
from kvsim.traces import TraceError, load_trace
from kvsim.traces.sessions import sharegpt_sessions, synthetic_sessions, with_session_starts

SMALL = {"trace": "synthetic-sessions", "trace_options.sessions": {},
         "trace_options.synthetic_sessions": {"sessions": 12, "turns": "uniform:2,5", "think_time_s": 2.0,
                                              "session_rate": 2.0},
         "engine.num_gpu_blocks": 8000}


def run(**sets):
    cfg = load_config(None, {**SMALL, **sets})
    return run_simulation(cfg)


def by_turn(df):
    return df.sort_values(["session", "turn"]).reset_index(drop=True)


def test_synthetic_sessions_grow_their_conversation_and_are_seeded():
    t = synthetic_sessions(30, turns="uniform:2,6", think_time_s=5.0, session_rate=1.0, seed=3)
    assert t.df.equals(synthetic_sessions(30, turns="uniform:2,6", think_time_s=5.0, session_rate=1.0, seed=3).df)
    assert not t.df.equals(synthetic_sessions(30, turns="uniform:2,6", think_time_s=5.0, session_rate=1.0, seed=4).df)
    for _, s in t.df.groupby("session_id"):
        held = (s["prompt_tokens"] + s["output_tokens"]).to_numpy()[:-1]
        assert (s["prompt_tokens"].to_numpy()[1:] > held).all()       # history plus a new message
        assert (np.diff(s["arrival_time_s"].to_numpy()) >= 0).all()
    assert t.df["session_id"].nunique() == 30 and 60 <= len(t) <= 180


def test_a_turn_is_released_when_its_predecessor_finished_plus_the_think_time():
    result = run(**{"trace_options.sessions": {"think_time_s": 1.5}})
    df = by_turn(result.requests)
    assert (df["status"] == "finished").all() and len(df) == result.summary["num_requests"]
    for _, s in df.groupby("session"):
        gaps = s["arrival_s"].to_numpy()[1:] - s["finish_s"].to_numpy()[:-1]
        np.testing.assert_allclose(gaps, 1.5, rtol=0, atol=1e-9)
    # the trace's gaps as think times (the default): the released turn comes later than in the trace
    default = by_turn(run().requests)
    trace = load_workload_df()
    first = default.groupby("session")["arrival_s"].min()
    assert np.isclose(first.to_numpy(), trace.groupby("session_id")["arrival_time_s"].min().to_numpy()).all()
    later = default[default["turn"] > 0]
    prev = default.shift(1)[default["turn"] > 0]
    assert (later["arrival_s"] > prev["finish_s"]).all()


def load_workload_df():
    from kvsim.sim.engine.assembly import load_workload
    return load_workload(load_config(None, SMALL)).df


def test_each_turn_hits_the_conversation_so_far_in_the_prefix_cache():
    df = by_turn(run().requests)
    later = df[df["turn"] > 0]
    prev = df.shift(1)[df["turn"] > 0]
    history = (prev["prompt_tokens"] + prev["output_tokens"]).to_numpy()
    # every full block of the previous prompt and answer (the pool is large: nothing was evicted); the
    # answer's last token was sampled, never computed: its KV is not there
    np.testing.assert_array_equal(later["cached_tokens"].to_numpy(), (history - 1) // 16 * 16)
    assert (df[df["turn"] == 0]["cached_tokens"] == 0).all()        # sessions share nothing


@pytest.mark.parametrize("sets", [{"replicas": 1}, {"replicas": 2, "router": "session_affinity"},
                                  {"replicas": 1, "trace_options.max_concurrency": 3}])
def test_fast_forward_gives_exactly_what_stepping_gives(sets):
    fast, slow = run(**sets), run(fast_forward=False, **sets)
    pd.testing.assert_frame_equal(fast.requests, slow.requests)


def test_session_affinity_keeps_a_session_on_one_replica_and_reuses_its_cache():
    sticky = by_turn(run(replicas=3, router="session_affinity").requests)
    assert (sticky.groupby("session")["replica"].nunique() == 1).all()
    assert sticky["replica"].nunique() == 3                          # sessions still spread
    spread = by_turn(run(replicas=3, router="round_robin").requests)
    assert spread.groupby("session")["replica"].nunique().max() > 1
    assert sticky["cached_tokens"].sum() > 1.5 * spread["cached_tokens"].sum()
    weighted = by_turn(run(replicas=3, router="weighted",
                           **{"router_options.weights": {"session": 5, "queue": 1}}).requests)
    assert (weighted.groupby("session")["replica"].nunique() == 1).all()


def test_sessions_with_cpu_offload_hold_the_tier_invariants():
    result = run(replicas=2, router="round_robin", kv_offload={"cpu_gib": 4}, check_invariants=True,
                 **{"engine.num_gpu_blocks": 300})
    off = result.summary["kv_offload"]
    assert off["external_prefix_cache_hits"] > 0 and (result.requests["status"] == "finished").all()


def test_max_concurrency_limits_the_sessions_in_flight():
    df = run(**{"trace_options.max_concurrency": 2}).requests
    events = sorted([(t, 1) for t in df["first_scheduled_s"]] + [(t, -1) for t in df["finish_s"]],
                    key=lambda e: (e[0], e[1]))
    assert max(np.cumsum([e[1] for e in events])) <= 2


# ----- sources ----------------------------------------------------------------------------------
def test_sharegpt_conversations_become_sessions(tmp_path):
    data = [{"id": "a", "conversations": [{"from": "human", "value": "hello there friend"},
                                          {"from": "gpt", "value": "hi, how can I help you today?"},
                                          {"from": "human", "value": "tell me a joke"},
                                          {"from": "gpt", "value": "why did the chicken cross the road"}]},
            {"id": "b", "conversations": [{"from": "system", "value": "be brief"},
                                          {"from": "human", "value": "what is two plus two"},
                                          {"from": "gpt", "value": "four"}]},
            {"id": "c", "conversations": [{"from": "human", "value": "unanswered"}]}]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    t = sharegpt_sessions(path, shuffle=False)
    df = t.df
    assert df["session_id"].tolist() == [0, 0, 1] and len(t) == 3
    a = df[df["session_id"] == 0]
    assert a["prompt_tokens"].iloc[1] > a["prompt_tokens"].iloc[0] + a["output_tokens"].iloc[0]
    # through the config: format sharegpt + sessions reads whole conversations
    cfg = load_config(None, {"trace": str(path), "trace_options.sessions": {"think_time_s": 0.5}})
    result = run_simulation(cfg)
    assert len(result.requests) == 3 and (result.requests["status"] == "finished").all()


def test_a_generic_log_with_session_and_turn_columns(tmp_path):
    path = tmp_path / "log.csv"
    path.write_text("ts,sid,turn,p,o\n0.0,s1,0,100,20\n0.5,s2,0,50,10\n3.0,s1,1,150,30\n4.0,s2,1,80,10\n")
    cols = "arrival=ts,session_id=sid,turn=turn,prompt_tokens=p,output_tokens=o"
    t = load_trace(path, format="csv", columns=cols)
    assert t.df["session_id"].tolist() == ["s1", "s2", "s1", "s2"]
    cfg = load_config(None, {"trace": str(path), "trace_options.format": "csv", "trace_options.columns": cols,
                             "trace_options.sessions": {}})
    df = by_turn(run_simulation(cfg).requests)
    s1 = df[df["session"] == 0]
    assert s1["arrival_s"].iloc[1] == pytest.approx(s1["finish_s"].iloc[0] + 3.0)     # the trace's gap


def test_turns_out_of_order_are_refused_naming_the_line_and_field(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("ts,sid,turn,p,o\n0.0,s1,0,100,20\n1.0,s1,2,150,30\n2.0,s1,1,180,30\n")
    cols = "arrival=ts,session_id=sid,turn=turn,prompt_tokens=p,output_tokens=o"
    with pytest.raises(TraceError) as err:
        load_trace(path, format="csv", columns=cols)
    text = str(err.value)
    assert "\n" not in text and ":4:" in text and "turn: session 's1' turn 1 arrives after its turn 2 (line 3)" in text
    with pytest.raises(TraceError, match="turn=turn needs session_id"):
        load_trace(path, format="csv", columns="arrival=ts,turn=turn,prompt_tokens=p,output_tokens=o")


def test_a_turn_shorter_than_its_history_is_refused_unless_history_append(tmp_path):
    path = tmp_path / "short.csv"
    path.write_text("ts,sid,p,o\n0.0,1,100,20\n3.0,1,30,10\n")
    cols = "arrival=ts,session_id=sid,prompt_tokens=p,output_tokens=o"
    base = {"trace": str(path), "trace_options.format": "csv", "trace_options.columns": cols}
    with pytest.raises(ConfigError, match=r"^trace_options\.sessions: request_id 1 \(session '1'\): prompt_tokens 30 is "
                                          r"shorter than the conversation before it \(120 tokens"):
        run_simulation(load_config(None, {**base, "trace_options.sessions": {}}))
    df = by_turn(run_simulation(load_config(None, {**base, "trace_options.sessions": {"history": "append"}})).requests)
    assert df["prompt_tokens"].tolist() == [100, 150] and df["cached_tokens"].iloc[1] == 112


def test_session_options_are_refused_where_they_cannot_apply():
    with pytest.raises(ConfigError, match="synthetic_sessions sets the shape of trace: synthetic-sessions"):
        load_config(None, {"trace_options.synthetic_sessions": {"sessions": 3}})
    with pytest.raises(ConfigError, match="think_time_s"):
        load_config(None, {"trace_options.sessions": {"think_time_s": -1}})
    with pytest.raises(ConfigError, match="sessions need arrival_unit: time"):
        load_config(None, {"trace_options.sessions": {}, "trace_options.arrival_unit": "step"})


def test_a_request_rate_starts_sessions_not_turns():
    t = synthetic_sessions(5, turns="fixed:3", think_time_s=1.0, session_rate=None, seed=0)
    moved = with_session_starts(t, [0.0, 10.0, 20.0, 30.0, 40.0])
    for sid, s in moved.df.groupby("session_id"):
        orig = t.df[t.df["session_id"] == sid]["arrival_time_s"].to_numpy()
        np.testing.assert_allclose(s["arrival_time_s"].to_numpy(), orig - orig[0] + 10.0 * sid)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_sessions_under_pressure_step_as_they_fast_forward(seed):
    """Random shapes, a small pool (evictions, preemptions) and the CPU tier: fast-forward == stepping, with
    the engine's and the tier's invariants checked at every step."""
    rng = np.random.default_rng(seed)
    sets = {"seed": seed, "replicas": int(rng.integers(1, 3)), "router": str(rng.choice(["session_affinity", "round_robin"])),
            "engine.num_gpu_blocks": int(rng.integers(250, 500)), "check_invariants": True,
            "trace_options.synthetic_sessions": {"sessions": 8, "turns": "uniform:1,5", "think_time_s": float(rng.uniform(0, 3)),
                                                 "first_tokens": "lognormal:800,1.0,3000", "session_rate": 3.0}}
    if rng.random() < 0.7:
        sets["kv_offload"] = {"cpu_gib": float(rng.uniform(0.2, 2))}
    fast, slow = run(**sets), run(fast_forward=False, **sets)
    pd.testing.assert_frame_equal(fast.requests, slow.requests)
    assert (fast.requests["status"] == "finished").all()


def test_set_key_null_starts_every_session_at_once():
    """`--set trace_options.synthetic_sessions.session_rate=null` is null (docs: all sessions at t=0), as in a
    YAML file, not dropped as an unset option would be (it used to fall back to 1 session a second)."""
    cfg = load_config(None, {**SMALL, "trace_options.synthetic_sessions": {"sessions": 12}},
                      ["trace_options.synthetic_sessions.session_rate=null"])
    assert cfg.trace_options.synthetic_sessions.session_rate is None
    from kvsim.sim.engine.assembly import load_workload
    first_turns = load_workload(cfg).df.groupby("session_id")["arrival_time_s"].min()
    assert (first_turns == 0).all()
