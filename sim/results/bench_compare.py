"""Predicted vs measured: a run of a `vllm bench serve --save-result --save-detailed` file against the
figures that file measured on a real server (how a user with a GPU checks kvsim on their hardware).

Per request (matched by the request's position in the file): TTFT, TPOT, mean ITL and E2EL, measured and
predicted. In aggregate: the `vllm bench serve` statistics (mean, median, p99 in ms; output and request
throughput) of both, with the relative error (predicted - measured) / measured.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from .vllm_metrics import bench_metrics

STATS = ("mean", "median", "p99")
METRICS = ("ttft", "tpot", "itl", "e2el")


def measured_table(measured: dict, output_tokens: pd.Series) -> pd.DataFrame:
    """The file's per-request figures (seconds) indexed by request_id."""
    ids = measured["request_id"]
    df = pd.DataFrame({"request_id": ids}).set_index("request_id")
    if "ttfts" in measured:
        df["ttft_s"] = np.asarray(measured["ttfts"], dtype=float)
    if "latencies" in measured:
        df["e2el_s"] = np.asarray(measured["latencies"], dtype=float)
    if "itls" in measured:
        df["itl_mean_s"] = [float(np.mean(x)) if x else np.nan for x in measured["itls"]]
    n_out = output_tokens.reindex(df.index).to_numpy(dtype=float)
    if {"ttft_s", "e2el_s"} <= set(df.columns):
        df["tpot_s"] = np.where(n_out > 1, (df["e2el_s"] - df["ttft_s"]) / np.maximum(n_out - 1, 1), np.nan)
    return df


def compare(measured: dict, requests: pd.DataFrame, predicted_summary: dict) -> tuple[pd.DataFrame, dict]:
    """(per-request table, aggregate dict) of a run of a bench result file against the file's measurements."""
    req = requests.set_index("request_id")
    meas = measured_table(measured, req["output_tokens"])
    itl_pred = [float(np.mean(np.diff(t))) if len(t) > 1 else np.nan for t in req["token_times_s"]]
    pred = pd.DataFrame({"ttft_s": req["ttft_s"], "tpot_s": req["tpot_s"], "itl_mean_s": itl_pred,
                         "e2el_s": req["e2e_s"]}, index=req.index)
    per = pd.DataFrame(index=meas.index)
    per["prompt_tokens"] = req["prompt_tokens"].reindex(meas.index)
    per["output_tokens"] = req["output_tokens"].reindex(meas.index)
    for col in ("ttft_s", "tpot_s", "itl_mean_s", "e2el_s"):
        if col in meas:
            per[f"measured_{col}"] = meas[col]
            per[f"predicted_{col}"] = pred[col].reindex(meas.index)
    agg: dict = {"num_requests": int(len(per))}
    measured_stats = _measured_stats(measured, per)
    for key, m in measured_stats.items():
        p = predicted_summary.get(key)
        agg[key] = {"measured": m, "predicted": p,
                    "error": (p - m) / m if p is not None and m not in (None, 0) and np.isfinite(m) else None}
    return per.reset_index(), agg


def _measured_stats(measured: dict, per: pd.DataFrame) -> dict:
    """The file's figures as vllm bench serve computes them (bench_metrics on the measured table)."""
    n = len(per)
    ttft = per.get("measured_ttft_s", pd.Series(np.nan, index=per.index)).to_numpy()
    e2el = per.get("measured_e2el_s", pd.Series(np.nan, index=per.index)).to_numpy()
    if np.isnan(ttft).all() or np.isnan(e2el).all():
        return {}
    start = np.zeros(n)
    token_times = []
    for i, itls in enumerate(measured.get("itls") or [[]] * n):
        token_times.append(np.cumsum([ttft[i], *itls]) if itls else np.array([ttft[i]]))
    table = pd.DataFrame({"status": "finished", "arrival_s": start, "prompt_tokens": per["prompt_tokens"].to_numpy(),
                          "output_tokens": per["output_tokens"].to_numpy(), "ttft_s": ttft, "e2e_s": e2el,
                          "finish_s": e2el, "token_times_s": token_times,
                          "tpot_s": per.get("measured_tpot_s", pd.Series(np.nan, index=per.index)).to_numpy()})
    stats = bench_metrics(table, start_s=0.0)
    out = {f"{s}_{m}_ms": stats[f"{s}_{m}_ms"] for m in METRICS for s in STATS if m != "itl" or "itls" in measured}
    duration = measured.get("duration")
    if duration:
        out["output_throughput"] = float(per["output_tokens"].sum()) / duration
        out["request_throughput"] = n / duration
    return out


def report_rows(agg: dict) -> list[tuple[str, str, str, str]]:
    """(figure, measured, predicted, error) rows for printing."""
    rows = []
    for key, v in agg.items():
        if not isinstance(v, dict):
            continue
        err = "" if v["error"] is None else f"{100 * v['error']:+.1f}%"
        fmt = "{:.2f}"
        rows.append((key, fmt.format(v["measured"]), "" if v["predicted"] is None else fmt.format(v["predicted"]),
                     err))
    return rows
