"""Capacity: load a sweep store or run a capacity search; capacity curve, cost, Pareto view and the
cheapest configuration that meets an SLO."""
import pandas as pd
import streamlit as st

from kvsim.dashboard import charts
from kvsim.dashboard.data import (DataError, capacity_by_group, drain_share, meets_slo, pareto_front, read_sweep_store,
                            resolve_user_path, varying_columns)
from kvsim.dashboard.forms import BASE, config_form, gui_message
from kvsim.dashboard.guard import check_run
from kvsim.dashboard.jobs import capacity_search_task
from kvsim.dashboard.ui import follow_job, keep_widget, run_button, running_job, start_job
from kvsim.sim.planning.capacity import check_rate_search, choose_sample, parse_slo, sample_warnings
from kvsim.sim.model.catalog import list_gpus, list_models
from kvsim.sim.config import ConfigError, SimConfig
from kvsim.sim.planning.plan import PlanResult, PlanSpace, plan_capacity
from kvsim.sim.planning.sweep import config_columns
from kvsim.traces.errors import TraceError
from kvsim.traces.windows import WINDOW_HELP

DEFAULT_SLO = "ttft_p99<=2s, tpot_p99<=100ms"
LOAD_COLUMNS = ["offered_rate_req_s", "trace_options.rate_scale", "replicas", "searched_value"]
BENEFIT_COLUMNS = ["goodput_req_s", "throughput_output_tok_s", "throughput_req_s"]
COST = "usd_per_m_output_tok"


ANSWER_FORMATS = {name: st.column_config.NumberColumn(name, format=fmt) for name, fmt in (
    ("max rate scale", "%.3g"), ("fewest replicas", "%d"), ("rate (req/s)", "%.3g"), ("goodput (req/s)", "%.3g"),
    ("TTFT p99 (s)", "%.3f"), ("TPOT p99 (ms)", "%.1f"), ("USD per M output tokens", "%.3f"))}
DRAIN_LIMIT = 0.5
MODES = {"rate": "highest arrival rate", "replicas": "fewest replicas",
         "plan": "cheapest configuration (models x GPUs x TP)"}
LOADS = {"representative": "representative sample (as the CLI)", "window": "time window",
         "first": "first N requests (sidebar)"}


def search_inputs(base, *values) -> str:
    """What a search depends on, to tell when shown results no longer match the inputs."""
    return repr((base.model_dump(mode="json") if base else None, values))


def sample_of(base: SimConfig, load: str, window: str | None):
    """The base config over the chosen load sample, and that sample (kvsim capacity's defaults)."""
    if load == "first":
        return choose_sample(base, None)
    opts = base.trace_options.model_copy(update={"max_requests": None})
    return choose_sample(base.model_copy(update={"trace_options": opts}), (window or "").strip() or None
                         if load == "window" else None)


def plan_task(base: SimConfig, constraints, models, gpus, tps, max_replicas: int, store):
    """A Job task: sim.planning.plan.plan_capacity in this process, cheapest proposals first."""
    def task(job):
        job.unit, job.run_total = "simulations", len(models) * len(gpus) * len(tps) * 4   # a guess: pruning cuts it

        def progress(search, n, row):
            job.run_done = min(job.run_done + 1, job.run_total - 1)
            job.check_cancel()
        space = PlanSpace(models=models, gpus=gpus, tps=tps, max_replicas=max_replicas)
        return plan_capacity(base, constraints, space, store=store, progress=progress)
    return task


def show_plan(result: PlanResult) -> pd.DataFrame:
    st.subheader("Cheapest configuration")
    for model, s in result.cheapest.items():
        row = s.answer_row
        st.success(f"{model}: {s.cand.gpu} TP{s.cand.tp} x {s.hi_ok} replicas = {s.hi_ok * s.cand.tp} GPUs, "
                   f"${s.hi_ok * s.cand.usd_per_replica_hour:.2f}/h, ${row.get(COST, float('nan')):.3f} per million "
                   f"output tokens")
    st.dataframe(pd.DataFrame([{
        "model": s.cand.model, "GPU": s.cand.gpu, "TP": s.cand.tp, "result": s.status, "note": s.note,
        "replicas": s.hi_ok if s.status == "answer" else None,
        "USD per hour": s.hi_ok * s.cand.usd_per_replica_hour if s.status == "answer" else None}
        for s in result.searches] + [{"model": c.model, "GPU": c.gpu, "TP": c.tp, "result": "cannot run", "note": why}
                                     for c, why in result.unfit]), hide_index=True, key="cap_plan_table")
    st.caption(f"{result.simulations} simulations, {result.wall_s:.1f} s")
    front = result.pareto()
    if len(front):
        st.dataframe(front[["model_key", "candidate", "replicas", "usd_per_hour", "ttft_p99_s", "tpot_p99_s"]],
                     hide_index=True, key="cap_pareto_table")
    return result.points()


def answer_table(answers) -> pd.DataFrame:
    return pd.DataFrame([{
        "gpu": gpu, "search": r.mode, "meets SLO somewhere": r.feasible, "boundary found": r.bounded,
        ("max rate scale" if r.mode == "rate" else "fewest replicas"): r.answer,
        "rate (req/s)": r.answer_rate_req_s, "goodput (req/s)": r.answer_metrics.get("goodput_req_s"),
        "TTFT p99 (s)": r.answer_metrics.get("ttft_p99_s"),
        "TPOT p99 (ms)": None if r.answer_metrics.get("tpot_p99_s") is None else r.answer_metrics["tpot_p99_s"] * 1e3,
        "USD per M output tokens": r.answer_metrics.get(COST),
    } for gpu, r in answers])


def warn_if_drain_dominated(answers) -> None:
    """Warn when, at a GPU's answer, most of the run is the queue draining after the last arrival."""
    for gpu, r in answers:
        if r.curve is None or r.answer_run_id is None:
            continue
        row = r.curve.set_index("run_id").loc[r.answer_run_id].to_dict()
        share = drain_share(row)
        if share > DRAIN_LIMIT:
            st.warning(f"{gpu}: at the answer, {share:.0%} of the run is the queue draining after the last of its "
                       f"{int(row['num_requests']):,} requests arrived, so goodput there measures how fast this "
                       f"batch drains, not a rate the server sustains. Raise Max requests (first N) in the sidebar "
                       f"until the answer stops moving.")


st.title("Capacity")
source = st.radio("Data", ["Run a capacity search", "Load a sweep store"], horizontal=True, key="cap_source")
table, answers = None, None
if source == "Load a sweep store":
    path = st.text_input("Store directory (`kvsim sweep` / `kvsim capacity --store`) or a Parquet file of rows",
                         key="cap_path").strip()
    if not path:
        st.info("A sweep store has one Parquet row per simulated configuration: its config columns "
                "(gpu, tp, trace_options.rate_scale, ...) and summary figures (goodput_req_s, ttft_p99_s, ...).")
        st.stop()
    try:
        table, failed, capacity = read_sweep_store(resolve_user_path(path))
    except DataError as exc:
        st.error(str(exc))
        st.stop()
    if len(failed):
        with st.expander(f"{len(failed)} failed run(s)"):
            st.dataframe(failed[["run_id", "error"]], hide_index=True)
    view_slo = None
    if capacity:
        st.caption(f"Capacity result in the store: {capacity['mode']} search, SLO {', '.join(capacity['slo'])}: "
                   f"answer {capacity['answer']} ({'feasible' if capacity['feasible'] else 'infeasible'})")
else:
    with st.sidebar:
        st.header("Base configuration")
        base, error = config_form(BASE)
    gpus = [g.name for g in list_gpus() if g.kind == "gpu"]
    for key in ("cap_gpus", "cap_mode", "cap_slo", "cap_evals", "cap_store", "cap_load", "cap_window", "cap_models",
                "cap_tps", "cap_max_replicas"):
        keep_widget(key)
    if st.query_params.get("load") in LOADS and "cap_load" not in st.session_state:    # a link: ?load=first
        st.session_state["cap_load"] = st.query_params["load"]
    mode = st.radio("Search for", list(MODES), horizontal=True, key="cap_mode", format_func=MODES.get)
    a, b = st.columns(2)
    if "cap_gpus" not in st.session_state:
        st.session_state["cap_gpus"] = [base.gpu] if base and base.gpu in gpus else gpus[:1]
    chosen = a.multiselect("GPUs", gpus, key="cap_gpus")
    st.session_state.setdefault("cap_slo", DEFAULT_SLO)
    slo_text = b.text_input("SLO (the search and every view below)", key="cap_slo",
                            help="constraints on summary metrics, e.g. ttft_p99<=2s, e2e_p90<=30s, slo_attainment>=0.99")
    load_choice = a.radio("Load", list(LOADS), key="cap_load", format_func=LOADS.get,
                          help="as `kvsim capacity`: the whole trace up to 4,000 requests, else its busiest window "
                               "of about 2,500; a window such as 10m@peak or 600:1200; or the sidebar's first N")
    window = b.text_input("Window", key="cap_window", disabled=load_choice != "window",
                          help=WINDOW_HELP) if load_choice == "window" else None
    models, tps = [], []
    if mode == "plan":
        names = [m.name for m in list_models()]
        st.session_state.setdefault("cap_models", [m for m in names if base and m.lower() == base.model.lower()][:1])
        st.session_state.setdefault("cap_tps", [1, 2, 4, 8])
        models = a.multiselect("Models", [m.name for m in list_models()], key="cap_models")
        tps = b.multiselect("TP degrees", [1, 2, 4, 8], key="cap_tps")
        st.session_state.setdefault("cap_max_replicas", 64)
        max_evals = a.number_input("Most replicas per configuration", min_value=1, max_value=1024,
                                   key="cap_max_replicas")
    else:
        st.session_state.setdefault("cap_evals", 24)
        max_evals = a.number_input("Max simulations per GPU", min_value=2, max_value=64, key="cap_evals")
    store = st.text_input("Save points to a store directory under the data directory (optional, resumable)",
                          key="cap_store").strip() or None
    try:
        if error:
            raise ConfigError(error)
        constraints = parse_slo(slo_text)
        if not chosen:
            raise ConfigError("pick at least one GPU")
        if mode == "plan" and not (models and tps):
            raise ConfigError("pick at least one model and one TP degree")
        store = str(resolve_user_path(store)) if store else None
        check_run(base)
    except (ConfigError, DataError) as exc:
        st.error(gui_message(str(exc)))
        chosen = []
    inputs = search_inputs(base, mode, chosen, slo_text, load_choice, window, models, tps, max_evals)
    if run_button("Search capacity", "cap_run", "Capacity", blocked=not chosen):
        try:
            sampled, sample = sample_of(base, load_choice, window)
            if mode == "rate":
                check_rate_search(sample)
        except (ConfigError, TraceError) as exc:
            st.error(gui_message(str(exc)))
            st.stop()
        task = (plan_task(sampled, constraints, models, chosen, tps, int(max_evals), store) if mode == "plan" else
                capacity_search_task(sampled, chosen, constraints, mode, int(max_evals), store))
        st.session_state["cap_pending"] = {"inputs": inputs, "slo": slo_text, "sample": sample.describe(),
                                           "warnings": sample_warnings(sample)}
        start_job("Capacity", task=task, config=sampled)
    stale = st.empty()
    if running_job() is not None and running_job().page == "Capacity" and st.session_state.get("cap_answers"):
        stale.warning(f"Stale: the results below are from the previous search "
                      f"({st.session_state.get('cap_answers_meta', {}).get('slo', '')}); a new search is running.")
    job = follow_job("Capacity")
    stale.empty()
    if job is not None and job.value:
        st.session_state["cap_answers"] = job.value
        st.session_state["cap_answers_meta"] = st.session_state.pop("cap_pending", {})
    answers = st.session_state.get("cap_answers")
    if not answers:
        st.info("For each GPU the search brackets the SLO boundary by doubling/halving the load, then bisects; "
                "the cheapest-configuration search finds each GPU x TP's fewest replicas, cheapest first.")
        st.stop()
    meta = st.session_state.get("cap_answers_meta", {})
    if meta.get("inputs") != inputs:
        st.warning("Stale: the inputs above changed since this search ran; its results are shown with its SLO "
                   f"({meta.get('slo', '?')}). Run the search again for the current inputs.")
    view_slo = meta.get("slo", slo_text)
    st.caption(meta.get("sample", ""))
    for line in meta.get("warnings", []):
        st.warning(line)
    if isinstance(answers, PlanResult):
        table = show_plan(answers)
    else:
        st.subheader("Capacity")
        st.dataframe(answer_table(answers), hide_index=True, key="cap_answers_table", column_config=ANSWER_FORMATS)
        table = pd.concat([r.curve for _, r in answers if r.curve is not None], ignore_index=True)
        warn_if_drain_dominated(answers)

if table is None or not len(table):
    st.stop()
numeric = [c for c in table.columns if pd.api.types.is_numeric_dtype(table[c]) and table[c].notna().any()]
config_cols = list(config_columns(SimConfig().model_dump(mode="json")))
groups = varying_columns(table, [c for c in config_cols if c not in LOAD_COLUMNS and c != "seed"])


def _short(value) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def pick(column, label, options, preferred, key):
    index = next((options.index(p) for p in preferred if p in options), 0)
    return column.selectbox(label, options, index=index, key=key, format_func=charts.column_title)


a, b, c = st.columns(3)
load = pick(a, "Load axis", numeric, LOAD_COLUMNS, "cap_x")
benefit = pick(b, "Benefit", numeric, BENEFIT_COLUMNS, "cap_y")
group = pick(c, "Group by", ["(none)"] + groups, ["gpu", "kv.policy", "model"], "cap_group")
group = None if group == "(none)" else group
if source == "Load a sweep store":
    view_slo = ", ".join(capacity["slo"]) if capacity else st.text_input(
        "SLO for the views below", value=st.session_state.get("cap_slo", DEFAULT_SLO), key="cap_slo_view")
st.caption(f"Views judged against the SLO {view_slo}")
try:
    ok = meets_slo(table, parse_slo(view_slo))
except (ConfigError, DataError) as exc:
    st.error(gui_message(str(exc)))
    st.stop()

left, right = st.columns(2)
left.plotly_chart(charts.xy_lines(table, load, benefit, group, "Capacity curve"), key="cap_curve",
                  config=charts.PLOT_CONFIG)
latency = "ttft_p99_s" if "ttft_p99_s" in table else benefit
right.plotly_chart(charts.xy_lines(table, load, latency, group, f"{charts.column_title(latency)} vs load"),
                   key="cap_latency", config=charts.PLOT_CONFIG)
answer_column = f"max {load} meeting the SLO"
st.dataframe(capacity_by_group(table, load, ok, group), hide_index=True, key="cap_capacity", column_config={
    answer_column: st.column_config.NumberColumn(f"highest {charts.column_title(load)} meeting the SLO", format="%.3g")})
if COST in table:
    left.plotly_chart(charts.xy_lines(table, load, COST, group, "Cost per million output tokens (USD)"),
                      key="cap_cost", config=charts.PLOT_CONFIG)
    feasible = table[ok]
    if len(feasible):
        right.plotly_chart(charts.xy_lines(feasible, COST, benefit, group, "Pareto view: points meeting the SLO",
                                           pareto_front(feasible, COST, benefit)), key="cap_pareto",
                           config=charts.PLOT_CONFIG)
st.subheader("Best configuration under the SLO")
best = table[ok].sort_values(COST if COST in table else benefit, ascending=COST in table, kind="stable")
if len(best):
    top = best.iloc[0]
    what = ", ".join(f"{charts.column_title(k)} {_short(top[k])}" for k in ([group] if group else []) + [load]
                     if k in top)
    cost = f"${top[COST]:.3f} per million output tokens, " if COST in table else ""
    st.success(f"Best: {what}: {cost}{charts.column_title(benefit)} {top[benefit]:.3g}")
    st.dataframe(best, hide_index=True, key="cap_best")
else:
    st.warning("No point meets the SLO.")
with st.expander("All points"):
    st.dataframe(table, hide_index=True)
