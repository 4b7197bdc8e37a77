"""snapkv / pyramidkv / ada_snapkv: optional decode-time compression, and recompute after a preemption
(generated tokens are not prompt)."""
import numpy as np
import pytest

from kvsim.sim.kv.policy import PolicyContext, get_policy
from kvsim.sim.kv.state import TokenState
from test_kv_manager import run


def ctx(layers=1, kv_heads=2):
    return PolicyContext("per_head", layers, kv_heads, 2 * kv_heads, 16, layers * kv_heads)


def test_recompute_prefill_cuts_only_the_prompt_and_keeps_generated_tokens():
    p = get_policy("snapkv", budget=3, obs_window=4, kernel_size=1)
    st = TokenState.dense(2, 30)                 # prompt 20 + 10 generated, prefilled again
    st.prompt_tokens = 20
    st.score[:] = np.arange(30)[None, :]          # generated tokens score highest: still not candidates
    st.score[:, [1, 2, 3]] = 100
    d = p.compress(st, ctx(), "prefill", None)
    kept = (st.live & ~d.evict)[0]
    assert st.pos[0][kept].tolist() == [1, 2, 3] + list(range(16, 30))
    # without the prompt length, it is a plain prefill of 30 tokens (generated ones ranked as prompt)
    st2 = TokenState.dense(2, 30)
    st2.score[:] = st.score
    assert (st2.live & ~p.compress(st2, ctx(), "prefill", None).evict)[0].sum() == 3 + 4


@pytest.mark.parametrize("name", ["snapkv", "pyramidkv", "ada_snapkv"])
def test_decode_compression_every_n_steps(name):
    p = get_policy(name, budget=8, obs_window=4, kernel_size=1, decode_compression="every_n", decode_interval=5)
    assert p.default_trigger == "every_step"
    assert get_policy(name, budget=8).default_trigger == "after_prefill"       # published: prefill only
    c = ctx(layers=4)
    st = TokenState.dense(c.rows, 40)
    st.score[:] = np.random.default_rng(0).random(st.score.shape)
    fired = [p.compress(st, c, "decode", None) is not None for _ in range(10)]
    assert fired == [False] * 4 + [True] + [False] * 4 + [True]
    dec = get_policy(name, budget=8, obs_window=4, kernel_size=1, decode_compression="every_n", decode_interval=1)
    d = dec.compress(st, c, "decode", None)
    kept = (st.live & ~d.evict).sum(axis=1)
    assert kept.mean() == pytest.approx(8 + 4, abs=0.5)         # budget + window per row on average
    assert (st.pos[st.live & ~d.evict] >= 36).sum() == c.rows * 4  # the window: the newest 4 tokens


def test_decode_compression_over_budget_bounds_every_head_through_a_long_generation():
    base = {"policy": "snapkv", "budget": 16, "layout": "per_head", "slot_strategy": "slot_reuse",
            "params": {"obs_window": 4}}
    off = run(base, n=2, prompt=32, output=150)
    on = run({**base, "params": {"obs_window": 4, "decode_compression": "over_budget"}}, n=2, prompt=32, output=150,
             check=True)
    live = lambda r: r[1]["live_slots"].max()
    # short prompt, long generation: prefill-only SnapKV keeps every generated token
    assert off[0]["evicted_tokens"] < on[0]["evicted_tokens"]
    assert live(on) < 0.5 * live(off)
    assert on[0]["num_finished"] == 2
    rows = on[3].rows                            # SmolLM2: 30 layers x 3 KV heads
    decode = on[1][on[1]["num_prefill_seqs"] == 0]
    assert decode["live_slots"].max() <= 2 * rows * (16 + 4 + 1)   # budget + window + the new token


def test_recomputed_requests_lose_only_prompt_tokens_end_to_end():
    # 6 requests in 24 blocks: some are preempted (recompute) after generating tokens; each prefill cut,
    # first or recomputed, evicts the same 64 - 16 - 4 prompt tokens and keeps every generated token
    s, _, req, _ = run({"policy": "snapkv", "budget": 16, "layout": "shared", "slot_strategy": "free_block",
                        "params": {"obs_window": 4}}, num_blocks=24, n=6, prompt=64, output=100)
    assert s["num_finished"] == 6 and req["preemptions"].max() >= 1
    assert (req["evicted_tokens"] == 44 * (1 + req["preemptions"])).all()
