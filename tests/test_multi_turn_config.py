"""vLLM's multi-turn benchmark config (benchmarks/multi_turn's generate_multi_turn.json) read as the sessions it
generates (traces/multi_turn.py): turn counts as vLLM rounds them, the first message with the common and the
conversation's prefix, the common prefix shared across sessions in the prefix cache; malformed files refused
in one line naming the field."""
import json

import numpy as np
import pytest

from kvsim.sim.config import load_config
from kvsim.sim.simulator.simulate import run_simulation
from kvsim.traces import TraceError, load_trace

CONFIG = {"filetype": "generate_conversations", "num_conversations": 24, "text_files": ["pg1184.txt"],
          "prompt_input": {"num_turns": {"distribution": "uniform", "min": 12, "max": 18},
                           "common_prefix_num_tokens": {"distribution": "constant", "value": 500},
                           "prefix_num_tokens": {"distribution": "lognormal", "average": 4000, "max": 20000},
                           "num_tokens": {"distribution": "uniform", "min": 120, "max": 160}},
          "prompt_output": {"num_tokens": {"distribution": "uniform", "min": 80, "max": 120}}}


def write(tmp_path, conf, name="generate_multi_turn.json"):
    path = tmp_path / name
    path.write_text(json.dumps(conf, indent=4))
    return path


def test_conversations_are_drawn_as_vllms_generator_draws_them(tmp_path):
    trace = load_trace(write(tmp_path, CONFIG), seed=3)
    df = trace.df
    assert trace.shared_prefix_tokens == 500 and (df["arrival_time_s"] == 0).all()
    turns = df.groupby("session_id").size()
    assert len(turns) == 24 and turns.between(6, 9).all()          # 12-18 messages, rounded up to even, / 2
    first = df.groupby("session_id")["prompt_tokens"].min()
    prefix = first - 500 - 120
    assert (first >= 500 + 120).all() and prefix.max() <= 20000 + 40
    assert 2500 < prefix.mean() < 5500                              # lognormal scaled to its average of 4,000
    for _, s in df.groupby("session_id"):                            # each turn the conversation so far
        p, o = s["prompt_tokens"].to_numpy(), s["output_tokens"].to_numpy()
        assert ((p[1:] - p[:-1] - o[:-1]) >= 120).all() and ((p[1:] - p[:-1] - o[:-1]) <= 160).all()
        assert o.min() >= 80 and o.max() <= 120
    assert load_trace(write(tmp_path, CONFIG), seed=3).df.equals(df)
    assert not load_trace(write(tmp_path, CONFIG), seed=4).df.equals(df)


def test_the_common_prefix_is_one_prefix_cache_entry_for_every_conversation(tmp_path):
    conf = {**CONFIG, "num_conversations": 6,
            "prompt_input": {**CONFIG["prompt_input"], "num_turns": {"distribution": "constant", "value": 2}}}
    cfg = load_config(None, {"trace": str(write(tmp_path, conf)), "trace_options.sessions": {},
                             "trace_options.max_concurrency": 1})
    reqs = run_simulation(cfg).requests.sort_values("arrival_s")
    cached = reqs["cached_tokens"].to_numpy()
    # one turn each, one at a time: the first computes the common prefix, every later one hits its 31 full blocks
    assert cached[0] == 0 and (cached[1:] == 496).all()
    without = load_config(None, {"trace": str(write(tmp_path, {**conf, "prompt_input": {
        **conf["prompt_input"], "common_prefix_num_tokens": {"distribution": "constant", "value": 0}}}, "none.json")),
        "trace_options.sessions": {}, "trace_options.max_concurrency": 1})
    assert (run_simulation(without).requests["cached_tokens"] == 0).all()


@pytest.mark.parametrize("change, said", [
    ({"prompt_output": None}, "missing 'prompt_output'"),
    ({"num_conversations": 0}, "num_conversations: expected a positive integer"),
    ({"prompt_input": {**CONFIG["prompt_input"], "num_tokens": {"distribution": "gamma"}}},
     "prompt_input.num_tokens: unknown distribution 'gamma'"),
    ({"prompt_input": {**CONFIG["prompt_input"], "num_turns": {"distribution": "uniform", "min": 9, "max": 3}}},
     "prompt_input.num_turns: expected 0 < min <= max"),
    ({"prompt_input": {**CONFIG["prompt_input"], "prefix_num_tokens": {"distribution": "constant"}}},
     "prompt_input.prefix_num_tokens: missing field 'value'"),
])
def test_a_malformed_config_is_refused_naming_the_field(tmp_path, change, said):
    conf = {k: v for k, v in {**CONFIG, **change}.items() if v is not None}
    with pytest.raises(TraceError, match=said) as err:
        load_trace(write(tmp_path, conf))
    assert "generate_multi_turn.json" in str(err.value) and "\n" not in str(err.value)


def test_lognormal_by_mean_and_sigma_and_caps(tmp_path):
    conf = {**CONFIG, "num_conversations": 400, "prompt_input": {
        **CONFIG["prompt_input"], "common_prefix_num_tokens": {"distribution": "constant", "value": 0},
        "prefix_num_tokens": {"distribution": "lognormal", "mean": 6.0, "sigma": 0.5, "max": 600}}}
    first = load_trace(write(tmp_path, conf)).df.groupby("session_id")["prompt_tokens"].min().to_numpy()
    prefix = first - 140
    assert prefix.max() <= 600 + 20 and np.median(prefix) == pytest.approx(np.exp(6.0), rel=0.2)
