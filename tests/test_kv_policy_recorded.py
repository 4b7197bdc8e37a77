"""The `recorded` policy: the simulator replays the real backend's eviction decisions, so the memory
state of a replay is reproduced step by step (kvsim crosscheck's recorded mode)."""
import numpy as np
import pandas as pd
import pytest
import yaml

from kvsim.sim.config import ConfigError, load_config
from kvsim.sim.crosscheck.comparison import CrosscheckError, first_divergence
from kvsim.sim.crosscheck.recorded import recorded_config, simulate_recorded
from kvsim.sim.kv.policies.recorded import RecordedDecisionsError
from kvsim.sim.kv.policy import PolicyContext, PolicyError, get_policy
from kvsim.sim.kv.state import TokenState
from kvsim.sim.simulator.simulate import run_simulation
from kvsim.traces.trace import Trace

BASE = {"model": "smollm2-135m", "gpu": "cpu-2core", "profile": "cpu-2core", "engine.block_size": 4,
        "engine.num_gpu_blocks": 17}
TRACE = Trace.from_columns(arrival_time_s=[0.0, 0.0, 0.01, 0.02], prompt_tokens=[21, 17, 25, 19],
                           output_tokens=[40, 36, 30, 38], name="tiny")
CASES = {
    "h2o-slot_reuse-shared": {"kv.policy": "h2o", "kv.budget": 30, "kv.slot_strategy": "slot_reuse"},
    # memory pressure: reclaim evicts, twice for one request in one step at times; compaction moves tokens
    "h2o-compact-per_head-pressure": {"kv.policy": "h2o", "kv.budget": 12, "kv.layout": "per_head",
                                      "kv.slot_strategy": "compact", "kv.trigger": "after_prefill+pressure"},
    "h2o-slot_reuse-shared-pressure": {"kv.policy": "h2o", "kv.budget": 12, "kv.slot_strategy": "slot_reuse",
                                       "kv.trigger": "after_prefill+pressure"},
}


@pytest.fixture(scope="module")
def small():
    torch = pytest.importorskip("torch")
    from kvsim.gpu.weights import load_smollm2
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_smollm2().truncated(2)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def replays(small, tmp_path_factory):
    from kvsim.gpu.replay import run_replay
    out = {}
    for name, kv in CASES.items():
        cfg = load_config(None, {**BASE, **kv})
        d = tmp_path_factory.mktemp(name)
        out[name] = (cfg, d, run_replay(cfg, d, model=small, trace=TRACE, check_cache=True))
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_recorded_simulation_reproduces_the_replay_memory_step_by_step(replays, case):
    cfg, d, real = replays[case]
    steps = real.steps
    assert steps["evicted_tokens"].sum() > 0
    rec = simulate_recorded(cfg, TRACE, steps["duration_s"].to_numpy(), replay_dir=d)
    check = first_divergence(steps, rec.steps)
    assert check["identical"], check
    assert check["steps_compared"] == len(steps) and "bytes_moved" in check["columns"]
    info = rec.summary["recorded_policy"]
    assert info["decisions_missing"] == 0 and info["decisions_replayed"] == len(real.decisions)
    assert info["decisions_replayed"] == steps["evicted_tokens"].sum()
    np.testing.assert_array_equal(rec.steps["time_s"], steps["time_s"])


def test_the_pressure_cases_are_not_trivial(replays):
    """Preemptions, pressure decisions, and a request evicted by two reclaim calls in one engine step."""
    _, _, shared = replays["h2o-slot_reuse-shared-pressure"]
    assert shared.steps["preemptions"].sum() > 0
    _, _, per_head = replays["h2o-compact-per_head-pressure"]
    d = per_head.decisions
    pressure = d[d["reason"] == "pressure"]
    assert pressure.groupby(["request_id", "engine_step"])["event"].nunique().max() >= 2
    assert (per_head.steps["bytes_moved"] > 0).any()


def test_rerunning_the_policy_on_synthetic_scores_diverges(replays):
    """Why recorded mode exists: h2o on the simulator's synthetic attention evicts other tokens."""
    cfg, d, real = replays["h2o-compact-per_head-pressure"]
    from kvsim.sim.crosscheck.recorded import replay_model_spec
    import json
    spec = replay_model_spec(cfg, json.loads((d / "summary.json").read_text()))
    own = run_simulation(cfg.model_copy(update={"fast_forward": False}), trace=TRACE, model=spec).steps
    assert not first_divergence(real.steps, own)["identical"]


def test_crosscheck_config_switches_evicting_policies_to_recorded(replays):
    cfg, d, _ = replays["h2o-slot_reuse-shared"]
    rec = recorded_config(cfg, d)
    assert rec.kv.policy == "recorded" and rec.kv.budget is None
    assert rec.kv.params == {"path": str(d), "trigger": "every_step"}
    assert (rec.kv.layout, rec.kv.slot_strategy) == (cfg.kv.layout, cfg.kv.slot_strategy)
    with pytest.raises(CrosscheckError, match="decisions.parquet"):
        recorded_config(cfg, None)                       # h2o needs scores: no replay, no recorded mode
    plain = load_config(None, BASE)
    assert recorded_config(plain, d) is plain            # policy none runs as it is
    other = cfg.model_copy(update={"kv": cfg.kv.model_copy(update={"trigger": "pressure"})})
    with pytest.raises(CrosscheckError, match="trigger 'every_step'"):
        recorded_config(other, d)
    # the same through a config: kv.policy=recorded, kv.params.path=<replay dir>
    via_cfg = load_config(None, {**BASE, "kv.policy": "recorded", "kv.params": {"path": str(d)},
                                 "kv.slot_strategy": "slot_reuse"})
    assert via_cfg.kv.policy == "recorded"


# ---- the policy on a hand-written decisions table ------------------------------------------------
def write_decisions(directory, rows, policy="h2o", trigger="policy", layout="per_head"):
    directory.mkdir(parents=True, exist_ok=True)
    cols = ["request_id", "step", "layer", "head", "position", "action", "engine_step", "reason", "num_tokens",
            "event"]
    df = pd.DataFrame(rows, columns=cols)
    for c in cols:
        if c not in ("action", "reason"):
            df[c] = df[c].astype("int64")
    df.to_parquet(directory / "decisions.parquet", index=False)
    (directory / "config.yaml").write_text(yaml.safe_dump({"kv": {"policy": policy, "trigger": trigger,
                                                                  "layout": layout}}))
    return directory


def ctx_per_head(layers=2, kv_heads=2):
    return PolicyContext("per_head", layers, kv_heads, kv_heads * 3, 4, layers * kv_heads)


def state_for(request_id, rows, num_tokens):
    st = TokenState.dense(rows, num_tokens)
    st.request_id = request_id
    return st


def test_policy_evicts_exactly_the_recorded_entries_at_the_recorded_points(tmp_path):
    E = "evict"
    d = write_decisions(tmp_path / "run", [
        # request 7 after prefill (10 tokens cached): layer 1 head 0 drops positions 2, 3; layer 0 head 1 drops 5
        (7, -1, 1, 0, 2, E, 0, "policy", 10, 0), (7, -1, 1, 0, 3, E, 0, "policy", 10, 0),
        (7, -1, 0, 1, 5, E, 0, "policy", 10, 0),
        # after decode step 1 (11 tokens)
        (7, 1, 0, 0, 9, E, 1, "policy", 11, 1),
        # two pressure decisions before the same step (11 tokens), in order
        (7, 1, 1, 1, 4, E, 2, "pressure", 11, 2), (7, 1, 1, 1, 6, E, 2, "pressure", 11, 3),
        (7, 1, 0, 0, 1, E, 2, "pressure", 11, 3),
    ])
    policy = get_policy("recorded", path=str(d))
    assert policy.default_trigger == "every_step" and not policy.needs_scores and policy.evicts
    ctx = ctx_per_head()
    st = state_for(7, ctx.rows, 10)
    st.live[:, 8] = False                            # slots are found by position, not by slot index
    st.pos[:, [5, 8]] = st.pos[:, [8, 5]]
    st.live[:, [5, 8]] = st.live[:, [8, 5]]
    policy.on_admit(st, ctx)
    mask = policy.compress(st, ctx, "prefill", None).evict
    expected = np.zeros_like(mask)
    expected[2, [2, 3]] = True                       # row = layer * kv_heads + head
    expected[1, 8] = True                            # position 5 sits in slot 8
    np.testing.assert_array_equal(mask, expected)
    assert policy.compress(state_for(8, ctx.rows, 10), ctx, "prefill", None) is None   # other request
    st2 = state_for(7, ctx.rows, 11)
    policy.on_admit(st2, ctx)
    assert np.argwhere(policy.compress(st2, ctx, "decode", None).evict).tolist() == [[0, 9]]
    first = policy.reclaim(st2, ctx, 4).evict
    assert np.argwhere(first).tolist() == [[3, 4]]
    second = policy.reclaim(st2, ctx, 4).evict
    assert np.argwhere(second).tolist() == [[0, 1], [3, 6]]
    assert policy.reclaim(st2, ctx, 4) is None                                          # nothing more recorded
    assert policy.replayed == 7 and policy.missing == 0


def test_shared_layout_rows_and_trigger_from_the_config(tmp_path):
    d = write_decisions(tmp_path / "s", [(1, -1, -1, -1, 0, "evict", 0, "policy", 4, 0)], policy="streaming",
                        trigger="after_prefill+pressure", layout="shared")
    policy = get_policy("recorded", path=str(d / "decisions.parquet"))
    assert policy.default_trigger == "after_prefill+pressure"
    ctx = PolicyContext("shared", 2, 3, 9, 4, 1)
    st = state_for(1, 1, 4)
    policy.on_admit(st, ctx)
    assert policy.compress(st, ctx, "prefill", None).evict.tolist() == [[True, False, False, False]]
    assert get_policy("recorded", path=str(d), trigger="every_n").default_trigger == "every_n"


def test_missing_or_mismatched_decisions_are_refused_naming_the_file(tmp_path):
    with pytest.raises(PolicyError, match=r"nowhere[/\\]decisions.parquet not found"):
        get_policy("recorded", path=str(tmp_path / "nowhere"))
    with pytest.raises(PolicyError, match="path is required"):
        get_policy("recorded")
    old = tmp_path / "old"
    old.mkdir()
    pd.DataFrame({"request_id": [1], "step": [0], "layer": [0], "head": [0], "position": [3],
                  "action": ["evict"]}).to_parquet(old / "decisions.parquet")
    with pytest.raises(PolicyError, match=r"old[/\\]decisions.parquet: missing column\(s\) "
                                                     r"\['engine_step', 'reason', 'num_tokens', 'event'\]"):
        get_policy("recorded", path=str(old))
    bad = write_decisions(tmp_path / "bad", [(1, -1, 0, 0, 3, "high", 0, "policy", 5, 0)])
    with pytest.raises(PolicyError, match="action 'high' cannot be replayed"):
        get_policy("recorded", path=str(bad))
    per_head = write_decisions(tmp_path / "ph", [(1, -1, 5, 0, 3, "evict", 0, "policy", 5, 0)])
    policy = get_policy("recorded", path=str(per_head))
    with pytest.raises(RecordedDecisionsError, match="layer 5 head 0 but the model has 2 layers x 2 KV heads"):
        policy.on_admit(state_for(1, 4, 5), ctx_per_head())
    with pytest.raises(RecordedDecisionsError, match="recorded with kv.layout=per_head but this run has "
                                                     "kv.layout=shared"):
        get_policy("recorded", path=str(per_head)).on_admit(state_for(1, 1, 5), PolicyContext("shared", 2, 2, 6, 4, 1))
    no_cfg = write_decisions(tmp_path / "nc", [(1, -1, 0, 0, 3, "evict", 0, "policy", 5, 0)])
    (no_cfg / "config.yaml").unlink()
    with pytest.raises(PolicyError, match="config.yaml not found: give kv.params.trigger"):
        get_policy("recorded", path=str(no_cfg))
    # through a config, the error is a ConfigError naming the file
    cfg = load_config(None, {**BASE, "kv.policy": "recorded", "kv.params": {"path": str(tmp_path / "nowhere")}})
    with pytest.raises(ConfigError, match="nowhere"):
        run_simulation(cfg, trace=TRACE)
