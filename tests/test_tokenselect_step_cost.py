"""TokenSelect's and Quest's selection work as the simulator's step cost charges it: decode reads
(the Selection Cache's reuse rate, Quest's scoring interval) and prefill query-key pairs (chunk-level
selection), against `none` on the same long prompt (sim/simulator/executor.py, sim/kv/policies/quest.py)."""
import numpy as np
import pandas as pd
import pytest

from kvsim.sim.config import load_config
from kvsim.sim.kv.policies.selection_work import prefill_speedup
from kvsim.sim.simulator.simulate import run_simulation
from kvsim.traces.synthetic import closed_batch

READ, CHUNK, REUSE = 2688, 8192, 0.21
CONTEXTS = (1 << 17, 1 << 18, 1 << 19)          # 128K, 256K, 512K prompts


@pytest.fixture(autouse=True)
def past_trained_positions(monkeypatch):
    # the prompts go past Qwen2.5-0.5B's 32,768 trained positions (TokenSelect's length extrapolation):
    # allowed, as in vLLM, by VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 (docs/simulate.md)
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")


def steps(tmp_path, prompt: int, kv: dict) -> pd.DataFrame:
    out = tmp_path / f"{kv['policy']}-{prompt}"
    cfg = load_config(None, {"model": "qwen2.5-0.5b", "gpu": "h100", "kv": kv,
                             "engine": {"max_num_batched_tokens": CHUNK, "max_model_len": prompt + 64}})
    run_simulation(cfg, out, trace=closed_batch(1, prompt, 4))
    return pd.read_parquet(out / "steps.parquet")


def attention_speedups(tmp_path, prompt: int, kv: dict) -> tuple[float, float]:
    """(decode, prefill) attention work of `none` over the policy's: KV read by the last decode step,
    query-key pairs of the whole prefill."""
    full, sel = steps(tmp_path, prompt, {"policy": "none"}), steps(tmp_path, prompt, kv)
    decode = full["kv_tokens_read"].iloc[-1] / sel["kv_tokens_read"].iloc[-1]
    return float(decode), float(full["attn_pairs_prefill"].sum() / sel["attn_pairs_prefill"].sum())


def tokenselect(reuse: float) -> dict:
    return {"policy": "tokenselect", "layout": "per_head", "mode": "fast",
            "params": {"budget": READ, "dense_layers": 0, "reuse_rate": reuse, "prefill_chunk": CHUNK}}


@pytest.mark.parametrize("reuse", [0.0, REUSE])
def test_tokenselect_decode_speedup_grows_with_context_towards_the_reuse_bound(tmp_path, reuse):
    s = np.array([attention_speedups(tmp_path, n, tokenselect(reuse))[0] for n in CONTEXTS])
    bound = 2 / (1 - reuse)                     # every key's K scored on the (1 - r) share of steps
    # the last decode step: n + 2 tokens cached before it, its own token read in full
    expected = [(n + 3) / (READ + (1 - reuse) * (n + 2) / 2 + 1) for n in CONTEXTS]
    assert s == pytest.approx(expected, rel=1e-5)       # the step log rounds reads to whole tokens
    assert (np.diff(s) > 0).all() and (s < bound).all()
    assert (s > 2).all() if reuse else (s < 2).all()


def test_tokenselect_prefill_is_charged_chunk_level_selection(tmp_path):
    s = np.array([attention_speedups(tmp_path, n, tokenselect(REUSE))[1] for n in CONTEXTS])
    assert s == pytest.approx([prefill_speedup(n, CHUNK, READ) for n in CONTEXTS], rel=1e-9)
    assert s[0] > 20 and (np.diff(s) > 0).all()


def test_dense_layers_and_quest_prefill_attend_in_full(tmp_path):
    n = CONTEXTS[0]
    dense = {**tokenselect(REUSE), "params": {**tokenselect(REUSE)["params"], "dense_layers": 2}}
    full_pairs = steps(tmp_path, n, {"policy": "none"})["attn_pairs_prefill"].sum()
    sel_pairs = steps(tmp_path, n, dense)["attn_pairs_prefill"].sum()
    share = 2 / 24                                 # Qwen2.5-0.5B: 24 layers, the first 2 dense
    assert sel_pairs == pytest.approx(share * full_pairs + (1 - share) * full_pairs / prefill_speedup(n, CHUNK, READ))
    quest = steps(tmp_path, n, {"policy": "quest", "layout": "per_head", "mode": "fast",
                                "params": {"budget": READ, "score_interval": 4}})
    assert quest["attn_pairs_prefill"].sum() == pytest.approx(full_pairs)


def test_quest_scoring_interval_divides_the_metadata_read(tmp_path):
    n = CONTEXTS[0]
    reads = {k: steps(tmp_path, n, {"policy": "quest", "layout": "per_head", "mode": "fast",
                                    "params": {"budget": READ, "dense_layers": 0, "score_interval": k}})
             ["kv_tokens_read"].iloc[-1] for k in (1, 4)}
    pages = -(-(n + 2) // 16)                    # the last decode step: n + 2 cached, its own token
    assert reads[1] == pytest.approx(READ + pages + 1, rel=1e-12)
    assert reads[4] == int(READ + pages / 4 + 1)            # the step log rounds reads to whole tokens
