"""Typed data between modules (issue 27): fast-mode profiles are FastModeProfile dataclasses, a request
carries typed fields instead of an untyped scratch dict."""
import dataclasses
import math

import numpy as np

import pytest

from kvsim.sim.core.request import Request, RequestStatus
from kvsim.sim.kv.policy import FastModeProfile, PolicyError, get_policy, policy_names
from kvsim.sim.results.metrics import REQUEST_COLUMNS, request_table


def test_every_policy_profile_is_typed():
    for name in policy_names():
        try:
            policy = get_policy(name)
        except (PolicyError, TypeError):
            continue                                    # needs parameters (e.g. a recorded file)
        profile = policy.fast_mode_profile()
        assert profile is None or isinstance(profile, FastModeProfile), name


def test_profile_is_frozen_with_the_defaults_of_an_unused_feature():
    p = FastModeProfile()
    assert (p.budget, p.protect_recent, p.age_weight, p.per_step, p.prompt_cut, p.sampled_rows) == \
        (None, 0, "uniform", 1, True, False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.budget = 3
    h2o = get_policy("h2o", budget=64, evict_per_step=1).fast_mode_profile()
    assert (h2o.budget, h2o.age_weight, h2o.prompt_cut) == (64, "young", False)


def test_request_has_no_untyped_scratch_dict():
    fields = {f.name: f.type for f in dataclasses.fields(Request)}
    assert "extra" not in fields
    assert not [n for n, t in fields.items() if str(t).startswith("dict")]


def test_request_table_reads_the_typed_kv_counters():
    done, plain = Request(0, 0.0, 10, 2), Request(1, 0.0, 10, 2)
    for r in (done, plain):
        r.token_times.extend([1.0, 2.0])
        r.num_output_tokens = 2
        r.first_scheduled_time = 0.5
        r.finish_time = 2.0
    done.kv_evicted_tokens, done.kv_mass_sum, done.kv_mass_steps = 3.5, 1.8, 2
    df = request_table([done, plain]).set_index("request_id")
    assert df.loc[0, "evicted_tokens"] == 3.5 and df.loc[0, "attention_mass_retained"] == pytest.approx(0.9)
    assert df.loc[1, "evicted_tokens"] == 0.0 and math.isnan(df.loc[1, "attention_mass_retained"])


def test_request_table_rows_in_id_order_each_with_its_own_token_times():
    """Rows sorted by request id (stable); each row's token_times_s holds that request's times, and the
    status, first-token and finish columns follow from them."""
    reqs = [Request(rid, float(rid), 10, 3) for rid in (5, 2, 9, 2)]
    times = {0: [0.5, 0.75, 1.0], 1: [2.25], 2: [], 3: [3.0, 4.0]}
    for i, r in enumerate(reqs):
        r.token_times.extend(times[i])
        r.num_output_tokens = len(times[i])
    reqs[0].status = reqs[1].status = reqs[3].status = RequestStatus.FINISHED
    reqs[2].status, reqs[2].reject_reason = RequestStatus.REJECTED, "too long"
    reqs[3].token_times = [3.0, 4.0]          # a list works as well as the engine's array('d')
    df = request_table(reqs)
    assert df["request_id"].tolist() == [2, 2, 5, 9]
    assert [t.tolist() for t in df["token_times_s"]] == [[2.25], [3.0, 4.0], [0.5, 0.75, 1.0], []]
    assert df["status"].tolist() == ["finished", "finished", "finished", "rejected"]
    assert df["first_token_s"].tolist()[:3] == [2.25, 3.0, 0.5] and math.isnan(df["first_token_s"].iloc[3])
    assert df["finish_s"].tolist()[:3] == [2.25, 4.0, 1.0] and math.isnan(df["finish_s"].iloc[3])
    assert df["reject_reason"].isna().tolist() == [True] * 3 + [False] and df["reject_reason"].iloc[3] == "too long"
    assert all(t.dtype == np.float64 for t in df["token_times_s"])
    assert list(df.columns) == list(REQUEST_COLUMNS) and len(request_table([])) == 0
