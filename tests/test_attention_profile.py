"""Where H2O's evictions fall and how often TokenSelect's Selection Cache hits: real SmolLM2-135M
attention against the importance model, and the simulator's memory and cost figures against them."""
import numpy as np
import pytest

from kvsim.sim.calibration.attention_profile import (
    eviction_profile, h2o_oracle, real_attention, selection_reuse, synthetic_attention)
from kvsim.sim.kv.policy import PolicyContext, get_policy
from kvsim.sim.kv.state import TokenState
from test_kv_manager import run

SMOLLM2 = PolicyContext("per_head", 30, 3, 9, 16, 90)
T, PROMPT, BUDGET = 400, 200, 128


@pytest.fixture(scope="module")
def real(request):
    pytest.importorskip("torch")
    request.getfixturevalue("one_thread")            # conftest: one torch thread for this module
    return real_attention(T, seed=0)


def test_h2o_oracle_evicts_one_lowest_scored_token_per_step():
    attn = np.tril(np.ones((1, 12, 12)))
    attn[0, :, 6] = 0.0                     # nobody attends to token 6
    attn /= attn.sum(axis=2, keepdims=True)
    ev = h2o_oracle(attn, prompt=9, budget=8, recent=2, obs_window=2)
    # 9 prompt tokens kept (no cut); each of the 3 decode steps evicts one: token 6 first
    assert ev.sum() == 3 and ev[0, 6] and not ev[0, :4].any()
    # kvsim's default H2O first cuts the prompt to the budget: one token at once, then one a step
    cut = h2o_oracle(attn, prompt=9, budget=8, recent=2, obs_window=2, prompt_cut=True)
    assert cut.sum() == 4 and cut[0, 6] and not cut[0, :4].any()


def test_real_smollm2_evictions_fall_where_the_importance_model_puts_them(real):
    attn, _ = real
    got = eviction_profile(attn, PROMPT, BUDGET)
    want = eviction_profile(synthetic_attention(SMOLLM2, "smollm2-135m", T), PROMPT, BUDGET)
    # measured (600 tokens, prompt 300, budgets 64-256, 2 texts): pages-freed share real 0.24-0.30,
    # model 0.26; the age deciles within a few points each
    assert abs(got.pages_freed_share - want.pages_freed_share) < 0.07, (got, want)
    assert np.abs(got.age_deciles - want.age_deciles).sum() < 0.2, (got.age_deciles, want.age_deciles)
    # the correlated CPU-fitted model concentrates evictions in whole pages far more than real attention
    fitted = eviction_profile(synthetic_attention(SMOLLM2, "smollm2-135m-fitted", T), PROMPT, BUDGET)
    assert fitted.pages_freed_share > got.pages_freed_share + 0.15


def test_free_block_frees_the_share_of_pages_the_model_implies():
    # token-level H2O (per step, one request) on the importance model gives back, through free_block,
    # the share of evicted slots in wholly evicted pages that the model's oracle profile implies
    implied = eviction_profile(synthetic_attention(SMOLLM2, "smollm2-135m", T), PROMPT, BUDGET)
    kv = {"policy": "h2o", "budget": BUDGET, "layout": "per_head", "slot_strategy": "free_block",
          "params": {"evict_per_step": 1}}
    s = run(kv, n=1, prompt=PROMPT, output=T - PROMPT + 1, num_blocks=4000)[0]
    share = s["blocks_freed_by_eviction"] * 16 / s["evicted_token_rows"]
    assert s["evicted_token_rows"] == implied.evictions
    assert abs(share - implied.pages_freed_share) < 0.03, (share, implied.pages_freed_share)


def test_selection_reuse_counts_steps_within_the_threshold_of_the_cached_query():
    q = np.array([[[1, 0], [1, 0.1], [0, 1], [0.1, 1], [1, 0]]], dtype=float)
    # step 1 reuses step 0's selection; step 2 selects anew; step 3 reuses it; step 4 selects
    assert selection_reuse(q, 0.95).tolist() == [0.5]
    assert selection_reuse(q, -1.0).tolist() == [1.0]


def test_real_smollm2_queries_reuse_a_selection_a_fifth_of_the_time_at_0_9(real):
    _, queries = real
    rate = selection_reuse(queries[6:], 0.9, start=PROMPT).mean()      # the selective layers (2 dense)
    assert 0.1 < rate < 0.35, rate                                       # measured 0.21 (600 tokens)
    assert selection_reuse(queries[6:], 0.8, start=PROMPT).mean() > rate


def test_selection_cache_and_score_interval_cut_the_metadata_reads():
    c = PolicyContext("per_head", 4, 1, 1, 16, 4)
    st = TokenState.dense(4, 1000)
    base = get_policy("tokenselect", budget=10, dense_layers=0).read_tokens(st, c)
    cached = get_policy("tokenselect", budget=10, dense_layers=0, reuse_rate=0.75).read_tokens(st, c)
    assert base.tolist() == [10 + 500] * 4 and cached.tolist() == [10 + 125] * 4
    quest = get_policy("quest", budget=32, page_size=16, dense_layers=0, score_interval=4).read_tokens(st, c)
    assert quest.tolist() == [32 + 63 / 4] * 4
    with pytest.raises(ValueError, match="reuse_rate must be a number in \\[0, 1\\)"):
        get_policy("tokenselect", reuse_rate=1.0)


def test_attention_speedup_grows_with_context_beyond_2x_with_the_cache():
    # selective attention's saving over full attention: n / (budget + (1 - r) n / 2) -> 2 / (1 - r)
    c = PolicyContext("per_head", 1, 1, 1, 16, 1)
    speed = {}
    for r in (0.0, 0.9):
        p = get_policy("tokenselect", budget=2048, dense_layers=0, reuse_rate=r)
        speed[r] = [n / p.read_tokens(TokenState.dense(1, n), c)[0] for n in (1 << 17, 1 << 19, 1 << 20)]
    assert all(s < 2 for s in speed[0.0])
    assert speed[0.9] == sorted(speed[0.9]) and speed[0.9][-1] > 15


def test_shared_oracle_evicts_per_sequence_on_the_rows_mean_score():
    # SpvLLM's H2O averages attention over layers and heads and evicts the same token from every head:
    # row 0 ignores token 5, row 1 token 6; the rows' mean ranks token 5 lowest (row 1 attends it least)
    T = 10
    attn = np.tril(np.ones((2, T, T)))
    attn[0, :, 5] = 0.0
    attn[1, :, 6] = 0.0
    attn[1, :, 5] = 0.5
    attn /= attn.sum(axis=2, keepdims=True)
    per_head = h2o_oracle(attn, prompt=9, budget=8, recent=2, obs_window=1)
    shared = h2o_oracle(attn, prompt=9, budget=8, recent=2, obs_window=1, shared=True)
    assert per_head[0, 5] and per_head[1, 6]                   # each head its own token
    assert (shared[0] == shared[1]).all() and shared[0, 5] and shared.sum() == 2
    assert eviction_profile(attn, 9, 8, 2, obs_window=1, shared=True).evictions == 2
