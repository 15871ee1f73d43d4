"""The simulator's Prometheus metrics: SGLang's sglang:* names, labels and buckets, plus sim_faults_injected_total."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from bench.sim.faults import FAULT_KINDS

# buckets copied from sglang/srt/observability/metrics_collector.py (0.5.23)
TTFT_BUCKETS = [0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400]
E2E_BUCKETS = [0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200,
               1800, 2400]
ITL_BUCKETS = [0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060, 0.080,
               0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000]
QUEUE_BUCKETS = [0.0, 0.001, 0.005, 0.010, 0.050, 0.100, 0.200, 0.500, 1, 2, 3, 4, 5, 10, 15, 20, 30, 40, 50,
                 60, 70, 80, 90, 100, 200, 300, 400, 500, 600, 700, 800, 900, 1000, 1200, 1400, 1600, 1800,
                 2000, 2500, 3000]


class SimMetrics:
    """One registry per server, so several simulators can live in one test process."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        # scheduler-side labels (rank 0 only) and tokenizer-side labels, as SGLang sets them
        self.sched = {"model_name": model_name, "engine_type": "unified", "tp_rank": "0", "pp_rank": "0",
                      "moe_ep_rank": "0"}
        self.tok = {"model_name": model_name, "engine_type": "unified"}
        s, t, r = list(self.sched), list(self.tok), self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, s, registry=r, multiprocess_mode="mostrecent")

        self.num_running_reqs = gauge("sglang:num_running_reqs", "The number of running requests.")
        self.num_queue_reqs = gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.")
        self.gen_throughput = gauge("sglang:gen_throughput", "The generation throughput (token/s).")
        self.token_usage = gauge("sglang:token_usage", "The token usage.")
        self.cache_hit_rate = gauge("sglang:cache_hit_rate", "The prefix cache hit rate.")
        self.utilization = gauge("sglang:utilization", "The utilization.")
        self.spec_accept_length = gauge(
            "sglang:spec_accept_length",
            "Mean acceptance length of speculative decoding (accepted drafts + bonus token per forward).")
        self.spec_accept_rate = gauge(
            "sglang:spec_accept_rate",
            "Speculative acceptance rate (`accepted drafts / proposed drafts` in batch).")
        self.queue_time = Histogram("sglang:queue_time_seconds", "Histogram of queueing time in seconds.", s,
                                    buckets=QUEUE_BUCKETS, registry=r)
        self.spec_verify_calls = Counter("sglang:spec_verify_calls_total",
                                         "Number of speculative decoding verification calls.", s, registry=r)

        ts = t + ["is_streaming"]
        self.prompt_tokens = Counter("sglang:prompt_tokens_total", "Number of prefill tokens processed.", ts,
                                     registry=r)
        self.generation_tokens = Counter("sglang:generation_tokens_total",
                                         "Number of generation tokens processed.", ts, registry=r)
        self.cached_tokens = Counter("sglang:cached_tokens_total",
                                     "Number of cached prompt tokens by source (device/host/storage).",
                                     t + ["cache_source"], registry=r)
        self.num_requests = Counter("sglang:num_requests_total", "Number of requests processed.", ts,
                                    registry=r)
        self.num_aborted = Counter("sglang:num_aborted_requests_total", "Number of requests aborted.", t,
                                   registry=r)
        self.ttft = Histogram("sglang:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", ts, buckets=TTFT_BUCKETS,
                              registry=r)
        self.itl = Histogram("sglang:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", t, buckets=ITL_BUCKETS,
                             registry=r)
        self.e2e = Histogram("sglang:e2e_request_latency_seconds",
                             "Histogram of End-to-end request latency in seconds", ts, buckets=E2E_BUCKETS,
                             registry=r)
        self.faults = Counter("sim_faults_injected_total", "Faults the simulator injected, by kind.", ["kind"],
                              registry=r)
        for kind in FAULT_KINDS:
            self.faults.labels(kind=kind)
        self.num_aborted.labels(**self.tok)
        self.spec_verify_calls.labels(**self.sched)

    def render(self) -> bytes:
        return generate_latest(self.registry)
