import numpy as np
import pytest

from kvsim.sim.model.catalog import get_gpu, get_model
from kvsim.sim.core.step import BatchShape
from kvsim.sim.model.cost_model import (
    FACTOR_OF_FEATURE, FEATURE_NAMES, CostModel, HardwareProfile, ProfileError, list_profiles, load_profile,
)

FIELDS = ("num_seqs", "num_prefill_tokens", "num_decode_tokens", "attn_pairs_prefill", "kv_tokens_read",
          "bytes_moved", "swap_bytes", "block_table_entries")


def decode(batch, context):
    return BatchShape(num_seqs=batch, num_decode_tokens=batch, kv_tokens_read=batch * context,
                      block_table_entries=batch * -(-context // 16))


def prefill(tokens, context=0):
    return BatchShape(num_seqs=1, num_prefill_tokens=tokens, attn_pairs_prefill=tokens * (context + (tokens + 1) / 2),
                      kv_tokens_read=context + tokens, block_table_entries=-(-(context + tokens) // 16))


@pytest.fixture(scope="module")
def h100_8b():
    return CostModel("llama-3.1-8b", "h100", "default")     # the plain roofline form, hand-set


def random_shapes(rng, n):
    seqs = rng.integers(1, 256, n).astype(np.float64)
    prefill_tokens = rng.integers(0, 4096, n).astype(np.float64)
    return BatchShape(num_seqs=seqs, num_prefill_tokens=prefill_tokens, num_decode_tokens=seqs - 1,
                      attn_pairs_prefill=prefill_tokens * rng.uniform(1, 4096, n),
                      kv_tokens_read=rng.uniform(0, 3e5, n), bytes_moved=rng.uniform(0, 1e9, n) * (rng.random(n) < .3),
                      swap_bytes=rng.uniform(0, 1e9, n) * (rng.random(n) < .2),
                      block_table_entries=rng.integers(0, 2_000_000, n).astype(np.float64),
                      kv_tokens_padded=rng.uniform(0, 6e5, n),
                      attn_pairs_prefill_padded=prefill_tokens * rng.uniform(1, 8192, n))


def padded_cpu():
    """A CPU profile whose attention pads decodes to the widest block table (as the real backend's)."""
    return load_profile("cpu-2core").model_copy(update={"padded_attn_cost": 37.5, "padded_prefill_cost": 20.0})


def test_default_profile_anchors_for_llama31_8b_on_h100(h100_8b):
    # Published vLLM figures the default profile was set against (see default.yaml).
    assert 6.0e-3 < h100_8b.predict(decode(1, 512)) < 7.0e-3
    assert 9.0e-3 < h100_8b.predict(decode(64, 1024)) < 12.0e-3
    assert 45e-3 < h100_8b.predict(prefill(2048)) < 70e-3


def test_decode_at_small_batch_is_memory_bound(h100_8b):
    m, g, p = h100_8b.model, h100_8b.gpu, h100_8b.profile
    assert not h100_8b.active_branches(decode(1, 512))["linear_compute_bound"]
    linear = h100_8b.breakdown(decode(1, 512))["linear"]
    weights_time = m.weight_bytes_read_per_step / (g.mem_bw * p.mem_bw_eff)
    assert weights_time < linear < 1.01 * weights_time     # weights dominate; activations are tiny
    # A memory-bound step barely notices more sequences; KV reads and overheads add the rest.
    t1, t8 = h100_8b.predict(decode(1, 512)), h100_8b.predict(decode(8, 512))
    assert t8 / t1 < 1.1


def test_large_prefill_is_compute_bound_and_scales_with_tokens(h100_8b):
    assert h100_8b.active_branches(prefill(8192))["linear_compute_bound"]
    f = h100_8b.features(prefill(8192))
    flops = 2 * h100_8b.model.linear_params * 8192
    assert f["linear_compute_prefill"] == pytest.approx(flops / 989.4e12)
    lin4k, lin8k = h100_8b.breakdown(prefill(4096))["linear"], h100_8b.breakdown(prefill(8192))["linear"]
    assert lin8k / lin4k == pytest.approx(2.0, rel=1e-3)
    att4k, att8k = h100_8b.breakdown(prefill(4096))["attention"], h100_8b.breakdown(prefill(8192))["attention"]
    assert att8k / att4k == pytest.approx(4.0, rel=1e-2)   # quadratic prefill attention


def test_decode_becomes_compute_bound_only_at_large_batch(h100_8b):
    branch = [bool(h100_8b.active_branches(decode(b, 128))["linear_compute_bound"]) for b in (1, 64, 512)]
    assert branch == [False, False, True]


@pytest.mark.parametrize("field", FIELDS)
def test_time_is_monotonic_in_every_field(h100_8b, field):
    rng = np.random.default_rng(1)
    base = random_shapes(rng, 200)
    more = BatchShape(**{f: getattr(base, f) for f in FIELDS})
    setattr(more, field, getattr(base, field) + rng.uniform(0, 1e4, 200))
    assert np.all(h100_8b.predict(more) >= h100_8b.predict(base))
    assert np.any(h100_8b.predict(more) > h100_8b.predict(base))


def test_scalar_and_array_paths_are_bit_identical():
    rng = np.random.default_rng(7)
    for cm in (CostModel("llama-3.1-8b", "h100"), CostModel("llama-3.1-70b", "a100", tp=4),
               CostModel("smollm2", "cpu-2core", "cpu-2core"), CostModel("smollm2", "cpu-2core", padded_cpu())):
        shapes = random_shapes(rng, 300)
        batch = cm.predict(shapes)
        assert batch.dtype == np.float64 and batch.shape == (300,)
        for i in range(300):
            scalar = cm.predict(BatchShape(**{f: getattr(shapes, f)[i]
                                              for f in (*FIELDS, "kv_tokens_padded", "attn_pairs_prefill_padded")}))
            assert isinstance(scalar, float)
            assert scalar == batch[i]
        ints = cm.predict(BatchShape(num_seqs=3, num_decode_tokens=3, kv_tokens_read=3000))
        assert ints == cm.predict(BatchShape(num_seqs=np.array([3.0]), num_decode_tokens=np.array([3.0]),
                                             kv_tokens_read=np.array([3000.0])))[0]


def test_tensor_parallel_speeds_up_sublinearly_and_adds_allreduce():
    shape = decode(64, 2048)
    models = {tp: CostModel("llama-3.1-70b", "h100", "default", tp=tp) for tp in (1, 2, 4, 8)}
    times = {tp: cm.predict(shape) for tp, cm in models.items()}
    assert times[1] > times[2] > times[4] > times[8]
    assert all(times[1] / times[tp] < tp for tp in (2, 4, 8))
    assert models[1].breakdown(shape)["allreduce"] == 0
    cm = models[4]
    p, m = cm.profile, cm.model
    size = 64 * m.hidden_size * 2
    expected = 2 * m.num_layers * (2 * 3 / 4 * size / 450e9 / p.allreduce_bw_eff + p.allreduce_latency_s)
    assert cm.breakdown(shape)["allreduce"] == pytest.approx(expected, rel=1e-12)


def test_kv_heads_split_across_tp_and_replicate_below_kv_head_count():
    assert CostModel("llama-3.1-70b", "h100", tp=4).kv_bytes_per_token_per_gpu == 327680 / 4
    smol = CostModel("smollm2", "h100", tp=9)          # 3 KV heads over 9 ranks: each holds one
    assert smol.kv_heads_per_gpu == 1 and smol.kv_bytes_per_token_per_gpu == 23040 / 3
    with pytest.raises(ValueError, match="tp=2 must divide num_heads=9"):
        CostModel("smollm2", "h100", tp=2)


def test_fp8_kv_halves_kv_read_time():
    bf16, fp8 = CostModel("llama-3.1-8b", "h100"), CostModel("llama-3.1-8b", "h100", kv_dtype="fp8")
    assert fp8.kv_bytes_per_token == bf16.kv_bytes_per_token / 2
    shape = decode(128, 4096)
    assert fp8.features(shape)["attn_memory"] == bf16.features(shape)["attn_memory"] / 2
    assert fp8.predict(shape) < bf16.predict(shape)


def test_fp8_weights_use_fp8_tensor_cores_only_where_present():
    shape = prefill(8192)
    for gpu, ratio in (("h100", 989.4 / 1978.9), ("a100", 1.0)):   # datasheet bf16 / fp8 peaks
        bf16 = CostModel("llama-3.1-70b", gpu, tp=8).features(shape)["linear_compute_prefill"]
        fp8 = CostModel("llama-3.1-70b-fp8", gpu, tp=8).features(shape)["linear_compute_prefill"]
        assert fp8 / bf16 == pytest.approx(ratio)
    mem_bf16 = CostModel("llama-3.1-70b", "h100", tp=8).features(decode(1, 1))["linear_memory"]
    mem_fp8 = CostModel("llama-3.1-70b-fp8", "h100", tp=8).features(decode(1, 1))["linear_memory"]
    assert 0.5 < mem_fp8 / mem_bf16 < 0.53


def test_copy_and_swap_costs(h100_8b):
    p = h100_8b.profile
    moved = h100_8b.breakdown(BatchShape(bytes_moved=1e9))["copy"]
    assert moved == pytest.approx(2e9 / (3.35e12 * p.copy_bw_eff))
    swapped = h100_8b.breakdown(BatchShape(swap_bytes=1e9))["swap"]
    assert swapped == pytest.approx(1e9 / (64e9 * p.pcie_eff))


def test_block_table_entries_cost_per_head_layout_overhead(h100_8b):
    shared = decode(64, 4096)
    per_head = BatchShape(**{f: getattr(shared, f) for f in FIELDS})
    per_head.block_table_entries = shared.block_table_entries * 32 * 8
    extra = h100_8b.predict(per_head) - h100_8b.predict(shared)
    assert extra == pytest.approx((per_head.block_table_entries - shared.block_table_entries)
                                  * h100_8b.profile.per_block_entry_overhead_s)


def test_padded_attention_costs_only_where_the_profile_pads():
    shape = BatchShape(num_seqs=4, num_decode_tokens=4, kv_tokens_read=2400, block_table_entries=152,
                       kv_tokens_padded=4 * 64 * 16)       # contexts up to 1,024: each padded to the longest
    for gpu, profile in (("h100", "default"), ("cpu-2core", "cpu-2core")):   # paged kernels: no padding cost
        cm = CostModel("smollm2", gpu, profile)
        assert cm.predict(shape) == cm.predict(BatchShape(**{f: getattr(shape, f) for f in FIELDS}))
    flat, padded = CostModel("smollm2", "cpu-2core", "cpu-2core"), CostModel("smollm2", "cpu-2core", padded_cpu())
    extra = padded.breakdown(shape)["attention"] - flat.breakdown(shape)["attention"]
    assert extra == pytest.approx(4096 * padded.kv_bytes_per_token / get_gpu("cpu-2core").mem_bw * 37.5, rel=1e-12)
    unknown = BatchShape(**{f: getattr(shape, f) for f in FIELDS})             # None: priced as kv_tokens_read
    same = BatchShape(**{f: getattr(shape, f) for f in FIELDS}, kv_tokens_padded=2400)
    assert padded.predict(unknown) == padded.predict(same) < padded.predict(shape)


def test_padded_prefill_attends_over_the_widest_table():
    # a 64-token prompt batched with a 1,024-token one attends over 1,024 (dead) slots plus itself
    chunks = np.array([64.0, 1024.0])
    shape = BatchShape(num_seqs=2, num_prefill_tokens=chunks.sum(), attn_pairs_prefill=float(np.sum(chunks * (chunks + 1) / 2)),
                       kv_tokens_read=chunks.sum(), block_table_entries=68,
                       attn_pairs_prefill_padded=float(np.sum(chunks * (1024 + chunks))))
    flat, padded = CostModel("smollm2", "cpu-2core", "cpu-2core"), CostModel("smollm2", "cpu-2core", padded_cpu())
    assert flat.predict(shape) == flat.predict(BatchShape(**{f: getattr(shape, f) for f in FIELDS}))
    extra = padded.breakdown(shape)["attention"] - flat.breakdown(shape)["attention"]
    pair_s = padded.model.attention_flops_per_pair() / get_gpu("cpu-2core").peak_flops(padded.model.activation_dtype)
    assert extra == pytest.approx(float(np.sum(chunks * (1024 + chunks))) * pair_s * 20.0, rel=1e-12)


def test_decode_runs_price_padding_as_steps_do():
    cm = CostModel("smollm2", "cpu-2core", padded_cpu())
    rng = np.random.default_rng(5)
    seqs = rng.integers(1, 64, 50).astype(np.float64)
    kv_read = seqs * rng.integers(1, 4000, 50)
    entries = np.ceil(kv_read / 16)
    padded = kv_read * rng.uniform(1, 3, 50)
    run = cm.predict_decode(seqs, kv_read, entries, padded)
    steps = cm.predict(BatchShape(num_seqs=seqs, num_decode_tokens=seqs, kv_tokens_read=kv_read,
                                  block_table_entries=entries, kv_tokens_padded=padded))
    assert (run == steps).all()
    assert (cm.predict_decode(seqs, kv_read, entries) == cm.predict_decode(seqs, kv_read, entries, kv_read)).all()
    counts = [x.astype(np.int64) for x in (seqs, kv_read, entries)]        # the fast-forward's int64 counts
    assert (cm.predict_decode(*counts) == cm.predict_decode(seqs, kv_read, entries)).all()


def test_decode_batch_factors_scale_pure_decode_steps_by_batch_size():
    """A profile's decode_batch_factors multiply pure-decode steps of b sequences (interpolated between
    listed sizes, the nearest listed size beyond them); prefill and mixed steps are unchanged, and the
    decode fast-forward's pricing still equals predict() bit for bit."""
    base = padded_cpu()
    plain = CostModel("smollm2", "cpu-2core", base)
    table = CostModel("smollm2", "cpu-2core", base.model_copy(update={"decode_batch_factors": {4: 1.1, 2: 0.9}}))
    assert list(load_profile("cpu-smollm2").decode_batch_factors) == [1, 2, 3, 4, 5, 8]   # sorted on load
    for b, k in ((1, 0.9), (2, 0.9), (3, 1.0), (4, 1.1), (16, 1.1)):
        assert table.predict(decode(b, 500)) == pytest.approx(k * plain.predict(decode(b, 500)), rel=1e-12)
    assert table.predict(prefill(300)) == plain.predict(prefill(300))
    mixed = BatchShape(num_seqs=4, num_prefill_tokens=100, num_decode_tokens=3, attn_pairs_prefill=5050,
                       kv_tokens_read=1600, block_table_entries=100)
    assert table.predict(mixed) == plain.predict(mixed)
    shapes = random_shapes(np.random.default_rng(4), 200)
    k = np.where(shapes.num_prefill_tokens > 0, 1.0, np.interp(shapes.num_seqs, [2, 4], [0.9, 1.1]))
    np.testing.assert_allclose(table.predict(shapes), k * plain.predict(shapes), rtol=1e-12)
    parts = table.breakdown(shapes)
    np.testing.assert_allclose(sum(v for n, v in parts.items() if n != "total"), parts["total"], rtol=1e-12)
    rng = np.random.default_rng(9)
    seqs = rng.integers(1, 12, 60).astype(np.float64)
    kv_read = seqs * rng.integers(1, 3000, 60)
    entries, padded = np.ceil(kv_read / 16), kv_read * rng.uniform(1, 3, 60)
    steps = table.predict(BatchShape(num_seqs=seqs, num_decode_tokens=seqs, kv_tokens_read=kv_read,
                                     block_table_entries=entries, kv_tokens_padded=padded))
    assert (table.predict_decode(seqs, kv_read, entries, padded) == steps).all()
    scalar = [table.predict(BatchShape(num_seqs=float(b), num_decode_tokens=float(b), kv_tokens_read=float(r),
                                       block_table_entries=float(e), kv_tokens_padded=float(p)))
              for b, r, e, p in zip(seqs, kv_read, entries, padded, strict=True)]
    assert scalar == steps.tolist()
    with pytest.raises(ValueError, match="decode_batch_factors"):
        base.model_validate({**base.model_dump(), "decode_batch_factors": {0: 1.0}})
    with pytest.raises(ValueError, match="decode_batch_factors"):
        base.model_validate({**base.model_dump(), "decode_batch_factors": {4: 0.0}})


def test_features_reconstruct_predict_for_a_fitter():
    """The documented linear-given-branches form that calibration fits reproduces predict()."""
    cm = CostModel("llama-3.1-8b", "h100", "default", tp=1)     # the plain form the step-log fitter fits
    shapes = random_shapes(np.random.default_rng(3), 500)
    X = cm.feature_matrix(shapes)
    branches = cm.active_branches(shapes)
    p = cm.profile.model_dump()
    coef = np.array([1 / p[f] if how == "div" else p[f] for f, how in (FACTOR_OF_FEATURE[n] for n in FEATURE_NAMES)])
    mask = np.ones_like(X)
    col = {name: i for i, name in enumerate(FEATURE_NAMES)}
    for name in ("linear_compute_prefill", "linear_compute_decode"):
        mask[:, col[name]] = branches["linear_compute_bound"]
    mask[:, col["linear_memory"]] = ~branches["linear_compute_bound"]
    mask[:, col["attn_compute"]] = branches["attn_compute_bound"]
    mask[:, col["attn_memory"]] = ~branches["attn_compute_bound"]
    np.testing.assert_allclose((X * mask) @ coef, cm.predict(shapes), rtol=1e-12)


def test_shipped_profiles_load():
    assert {"default", "cpu-2core"} <= set(list_profiles())
    assert load_profile().name == "default"
    assert load_profile("cpu-2core").step_overhead_s > load_profile("default").step_overhead_s


def profile_text(**override):
    fields = load_profile().model_dump()
    fields.update(override)
    return "\n".join(f"{k}: {v!r}" if isinstance(v, str) else f"{k}: {v}" for k, v in fields.items() if k != "meta")


@pytest.mark.parametrize("override,message", [
    ({"mfu_decode": 0}, "field 'mfu_decode': Input should be greater than 0"),
    ({"attn_bw_eff": -0.5}, "field 'attn_bw_eff': Input should be greater than 0"),
    ({"mem_bw_eff": 1.5}, "field 'mem_bw_eff': Input should be less than or equal to 1"),
    ({"step_overhead_s": -1e-3}, "field 'step_overhead_s': Input should be greater than or equal to 0"),
    ({"mfu": 0.5}, "field 'mfu': unknown field"),
])
def test_profile_validation_names_file_line_and_field(tmp_path, override, message):
    path = tmp_path / "bad.yaml"
    path.write_text(profile_text(**override))
    key = next(iter(override))
    line = next(i for i, text in enumerate(path.read_text().splitlines(), 1) if text.startswith(f"{key}:"))
    with pytest.raises(ProfileError) as err:
        load_profile(path)
    assert f"{path}:{line}: {message}" in str(err.value)


def test_profile_missing_field_and_unknown_name(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(profile_text().replace("mfu_prefill: 0.55\n", ""))
    with pytest.raises(ProfileError, match="field 'mfu_prefill': Field required"):
        load_profile(path)
    with pytest.raises(ProfileError, match="unknown hardware profile 'b300'.*default"):
        load_profile("b300")


def test_profile_round_trip(tmp_path):
    fitted = load_profile().model_copy(update={"name": "fitted", "mfu_decode": 0.42, "meta": {"mape": 0.03}})
    assert load_profile(fitted.to_yaml(tmp_path / "fitted.yaml")) == fitted


def test_accepts_specs_and_profile_objects():
    profile = HardwareProfile(**{**load_profile().model_dump(), "step_overhead_s": 0.0})
    cm = CostModel(get_model("smollm2"), get_gpu("l4"), profile)
    assert cm.breakdown(BatchShape())["total"] == 0.0       # an empty step costs nothing here


@pytest.mark.parametrize("model,gpu,tp,overlap", [("llama-3.1-8b", "h100", 1, True), ("llama-3.1-8b", "h100", 1, False),
                                                  ("llama-3.1-70b", "h100", 4, True), ("qwen3-30b-a3b", "h100", 1, True),
                                                  ("deepseek-v3", "h200", 8, False), ("llama-3.1-8b", "scaled", 2, True)])
def test_operator_form_fast_paths_equal_the_breakdown_bit_for_bit(model, gpu, tp, overlap):
    """The engine prices single steps (`predict` on scalars) and decode runs (`predict_decode`) without
    the per-part dicts; both must give the breakdown's total exactly, or simulated clocks drift."""
    profile = "auto"
    if gpu == "scaled":                     # a profile scaled by a capacity search's step_time_scale
        gpu, profile = "h100", load_profile("h100-sxm").model_copy(update={"step_time_scale": 1.25})
    cm = CostModel(model, gpu, profile, tp=tp, async_scheduling=overlap)
    assert cm.profile.operator_form
    shapes = random_shapes(np.random.default_rng(11), 300)
    shapes.op_flops, shapes.op_bytes = shapes.bytes_moved * 3.0, shapes.swap_bytes * 0.5
    total = cm.breakdown(shapes)["total"]
    for i in range(300):
        one = BatchShape(**{f: float(getattr(shapes, f)[i]) for f in ("num_seqs", "num_prefill_tokens", "num_decode_tokens",
                            "attn_pairs_prefill", "kv_tokens_read", "bytes_moved", "swap_bytes", "block_table_entries",
                            "op_bytes", "op_flops")})
        assert cm.predict(one) == cm.breakdown(one)["total"] == total[i]
    seqs = shapes.num_seqs.copy()
    seqs[::37] = 0.0                        # steps computing nothing keep their [ran] factors
    # whole counts are priced from a table over counts (grown past its first 1,025 here), others term by term
    for counts in (seqs, seqs * 20, seqs + 0.5):
        run = cm.predict_decode(counts, shapes.kv_tokens_read, shapes.block_table_entries)
        ref = cm.breakdown(BatchShape(num_seqs=counts, num_decode_tokens=counts, kv_tokens_read=shapes.kv_tokens_read,
                                      block_table_entries=shapes.block_table_entries))["total"]
        assert (run == ref).all()
        if (counts == counts.astype(np.int64)).all():       # the fast-forward passes int64 counts
            ints = [x.astype(np.int64) for x in (counts, shapes.kv_tokens_read, shapes.block_table_entries)]
            assert (cm.predict_decode(*ints) == cm.predict_decode(*(x.astype(np.float64) for x in ints))).all()
            # an admitting run prices its short stretches in Python (sim/engine/bulk/admitting_runs.py): the same bits
            assert cm.decode_prices(*(x.tolist() for x in ints)) == cm.predict_decode(*ints).tolist()
