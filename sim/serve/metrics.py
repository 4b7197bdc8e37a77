"""vLLM's Prometheus metrics (names, types, labels and buckets of vllm/v1/metrics/loggers.py) of the
simulated engine, with prometheus_client: vLLM's Grafana dashboard reads them unchanged.

Labels: model_name (the served name) and engine (the replica). Times are in the simulated engine's
seconds (what the modelled vLLM would report; at --time-scale k they pass k times faster than the wall
clock). Engine-state figures (running, waiting, KV usage, preemptions, prefix-cache queries and hits)
are read from the engine at each scrape; per-request figures are recorded as the engine produces
tokens and finishes requests (`RequestMetrics`), and per-step figures from its step rows (`StepSink`)."""
from __future__ import annotations

from bisect import bisect_left
from itertools import accumulate

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from kvsim.sim.core.request import Request

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
TOKEN_LATENCY_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                         10.0, 20.0, 40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
FINISH_REASONS = ("stop", "length", "abort")
LABELS = ["model_name", "engine"]


def buckets_1_2_5(max_value: int) -> list[int]:
    """vLLM's build_1_2_5_buckets: 1, 2, 5, 10, 20, 50, ... up to max_value."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


class EngineState:
    """The engine-state metrics, read from the replicas at each scrape."""

    def __init__(self, model_name: str, replicas: list, lag=lambda: 0.0):
        self.model_name, self.replicas, self.lag = model_name, replicas, lag

    def collect(self):
        running = GaugeMetricFamily("vllm:num_requests_running", "Number of requests in model execution batches.",
                                    labels=LABELS)
        waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                                    labels=LABELS)
        usage = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                                  labels=LABELS)
        preempt = CounterMetricFamily("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                                      labels=LABELS)
        queries = CounterMetricFamily("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens.", labels=LABELS)
        hits = CounterMetricFamily("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                                   labels=LABELS)
        # the names vLLM 0.9-0.11 also served (deprecated, still read by dashboards and gateways)
        old_usage = GaugeMetricFamily("vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage."
                                      "DEPRECATED: Use vllm:kv_cache_usage_perc instead.", labels=LABELS)
        old_queries = CounterMetricFamily("vllm:gpu_prefix_cache_queries", "GPU prefix cache queries, in terms of "
                                          "number of queried tokens.", labels=LABELS)
        old_hits = CounterMetricFamily("vllm:gpu_prefix_cache_hits", "GPU prefix cache hits, in terms of number of "
                                       "cached tokens.", labels=LABELS)
        for rep in self.replicas:
            labels = [self.model_name, str(rep.index)]
            sched, kv = rep.scheduler, rep.kv
            running.add_metric(labels, len(sched.running) - len(sched.finishing))
            waiting.add_metric(labels, len(sched.waiting))
            kv_usage = kv.pool.num_used_blocks / kv.pool.num_blocks
            usage.add_metric(labels, kv_usage)
            old_usage.add_metric(labels, kv_usage)
            preempt.add_metric(labels, sched.num_preemptions)
            lookups = kv.prefix_lookups
            for family, value in ((queries, lookups.queries), (hits, lookups.hits), (old_queries, lookups.queries),
                                  (old_hits, lookups.hits)):
                family.add_metric(labels, value)
        lag = GaugeMetricFamily("kvsim:engine_lag_seconds", "How far the simulated engine is behind the wall clock "
                                "(simulated seconds; > 0 while the server's CPU cannot keep up with --time-scale).")
        lag.add_metric([], self.lag())
        return [running, waiting, usage, preempt, queries, hits, old_usage, old_queries, old_hits, lag]


class Histogram:
    """A Prometheus histogram's state (per-bucket counts and the sum): an observation is a bisect and two
    additions, a tenth of prometheus_client's (the inter-token latency takes one per token streamed)."""
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds):
        self.bounds = [float(b) for b in bounds]
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1       # le semantics: a value on a bound counts there
        self.sum += value

    def buckets(self) -> list[tuple[str, int]]:
        cumulative = list(accumulate(self.counts))
        return [(floatToGoString(b), c) for b, c in zip(self.bounds, cumulative, strict=False)] + [("+Inf", cumulative[-1])]


# (attribute, vLLM name, help, buckets: a list, or "tokens" for 1-2-5 buckets up to max_model_len)
HISTOGRAMS = (
    ("ttft", "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS),
    ("itl", "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", TOKEN_LATENCY_BUCKETS),
    ("tpot", "vllm:request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds per request.",
     TOKEN_LATENCY_BUCKETS),
    ("e2e", "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
     REQUEST_LATENCY_BUCKETS),
    ("queue", "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
     REQUEST_LATENCY_BUCKETS),
    ("inference", "vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.",
     REQUEST_LATENCY_BUCKETS),
    ("prefill", "vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
     REQUEST_LATENCY_BUCKETS),
    ("decode", "vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
     REQUEST_LATENCY_BUCKETS),
    ("prompt_hist", "vllm:request_prompt_tokens", "Number of prefill tokens processed.", "tokens"),
    ("generation_hist", "vllm:request_generation_tokens", "Number of generation tokens processed.", "tokens"),
    ("max_tokens", "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", "tokens"),
    ("max_generation", "vllm:request_max_num_generation_tokens",
     "Histogram of maximum number of requested generation tokens.", "tokens"),
    ("params_n", "vllm:request_params_n", "Histogram of the n request parameter.", [1, 2, 5, 10, 20]),
    ("prefill_kv", "vllm:request_prefill_kv_computed_tokens",
     "Histogram of new KV tokens computed during prefill (excluding cached tokens).", "tokens"),
    ("iteration", "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
     ITERATION_TOKEN_BUCKETS),
)

# vLLM 0.11 served the inter-token latency under its old name too (vLLM's Grafana dashboard reads it)
DEPRECATED_HISTOGRAMS = (
    ("itl", "vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.DEPRECATED: Use "
     "vllm:inter_token_latency_seconds instead.", TOKEN_LATENCY_BUCKETS),
)


class RequestMetrics:
    """The per-request and per-token metrics (one set per engine), recorded in the engine's (simulated)
    seconds; a prometheus_client collector."""

    def __init__(self, model_name: str, max_model_len: int, replicas: int):
        self.model_name, self.replicas = model_name, replicas
        tokens = buckets_1_2_5(max_model_len)
        for attr, _, _, bounds in HISTOGRAMS:
            setattr(self, attr, [Histogram(tokens if bounds == "tokens" else bounds) for _ in range(replicas)])
        self.prompt_tokens = [0] * replicas
        self.generation_tokens = [0] * replicas
        self.success = {reason: [0] * replicas for reason in FINISH_REASONS}

    def tokens(self, req: Request, start: int, end: int) -> None:
        """Output tokens start..end-1 of `req` were produced."""
        i = req.replica
        times = req.token_times
        if start == 0:
            self.prompt_tokens[i] += req.prompt_tokens
            self.ttft[i].observe(times[0] - req.arrival_time)
        itl = self.itl[i]
        for j in range(max(start, 1), end):
            itl.observe(times[j] - times[j - 1])
        self.generation_tokens[i] += end - start

    def finished(self, req: Request, finish_reason: str, max_tokens: int) -> None:
        i, times = req.replica, req.token_times
        n = len(times)
        first, last, scheduled = times[0], times[-1], req.first_scheduled_time
        self.success[finish_reason][i] += 1
        self.e2e[i].observe(last - req.arrival_time)
        self.queue[i].observe(scheduled - req.arrival_time)
        self.prefill[i].observe(first - scheduled)
        self.decode[i].observe(last - first)
        self.inference[i].observe(last - scheduled)
        self.tpot[i].observe((last - first) / (n - 1) if n > 1 else 0.0)
        self.prompt_hist[i].observe(req.prompt_tokens)
        self.generation_hist[i].observe(n)
        self.max_tokens[i].observe(max_tokens)
        self.max_generation[i].observe(max_tokens)
        self.params_n[i].observe(1)
        self.prefill_kv[i].observe(req.prompt_tokens - req.num_cached_tokens)

    def aborted(self, req: Request) -> None:
        """`req` was aborted (its client went away): vLLM counts it under finished_reason="abort" and records no
        latency of it (its tokens so far are in the token counters and the TTFT/inter-token histograms)."""
        self.success["abort"][req.replica] += 1

    def collect(self):
        engines = [[self.model_name, str(i)] for i in range(self.replicas)]
        for name, doc, values in (("vllm:prompt_tokens", "Number of prefill tokens processed.", self.prompt_tokens),
                                  ("vllm:generation_tokens", "Number of generation tokens processed.",
                                   self.generation_tokens)):
            family = CounterMetricFamily(name, doc, labels=LABELS)
            for labels, value in zip(engines, values, strict=True):
                family.add_metric(labels, value)
            yield family
        success = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                      labels=LABELS + ["finished_reason"])
        for reason, counts in self.success.items():
            for labels, value in zip(engines, counts, strict=True):
                success.add_metric(labels + [reason], value)
        yield success
        for attr, name, doc, _ in HISTOGRAMS + DEPRECATED_HISTOGRAMS:
            family = HistogramMetricFamily(name, doc, labels=LABELS)
            for labels, hist in zip(engines, getattr(self, attr), strict=True):
                family.add_metric(labels, hist.buckets(), hist.sum)
            yield family


class StepSink:
    """Takes the engine's step rows in place of a StepLog (sim/results/metrics.py): each step's token count goes to
    vllm:iteration_tokens_total and the row is dropped (a server runs for as long as it is up)."""

    def __init__(self, metrics: RequestMetrics):
        self.metrics = metrics
        self.num_rows = 0

    def append(self, row: dict) -> None:
        self.metrics.iteration[row["replica"]].observe(row["prefill_tokens"] + row["decode_tokens"])
        self.num_rows += 1

    def append_columns(self, rows: dict, k: int) -> None:
        hist = self.metrics.iteration[rows["replica"]]
        prefill, decode = rows["prefill_tokens"], rows["decode_tokens"]
        for j in range(k):
            hist.observe((prefill if isinstance(prefill, int) else prefill[j]) + int(decode[j]))
        self.num_rows += k


def cache_config_info(registry: CollectorRegistry, plan) -> None:
    """vllm:cache_config_info: the KV cache's settings as labels of a gauge set to 1 (vLLM's info metric)."""
    eng = plan.cfg.engine
    info = {"block_size": str(eng.block_size), "num_gpu_blocks": str(plan.num_blocks),
            "enable_prefix_caching": str(bool(eng.enable_prefix_caching)), "engine": "0"}
    Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", list(info),
          registry=registry).labels(**info).set(1)
