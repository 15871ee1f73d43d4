"""Every router_* metric and its labels, declared on a registry passed in; label values come from config only."""
from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

from router.policy import POOLS

# Latency buckets span a fast proxy hop to a long generation.
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
# Predicted over measured latency: 1 is exact; the buckets are symmetric in log around it.
_RATIO = (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.11, 1.25, 1.5, 2.0, 4.0)
# Latency targets (router.slo): per kind, and the outcome of a request that had targets.
SLO_KINDS = ("ttft", "tpot")
MET, MISSED, SHED, UNMEASURED = "met", "missed", "shed", "unmeasured"


class Metrics:
    """The router's metrics. Pools, backends (configured URLs), reasons and kinds are closed sets."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.inflight = Gauge("router_inflight_requests", "Requests in flight per backend (held leases)",
                              ["pool", "backend"], registry=registry)
        self.requests = Counter("router_requests_total", "Requests answered, by HTTP status sent to the client",
                                ["pool", "backend", "code"], registry=registry)
        self.decisions = Counter("router_route_decisions_total", "Routing decisions by pool and reason",
                                 ["pool", "reason"], registry=registry)
        self.duration = Histogram("router_request_duration_seconds", "Request duration as seen by the router",
                                  ["pool"], buckets=_LATENCY, registry=registry)
        self.ttft = Histogram("router_time_to_first_token_seconds", "Time to the first streamed chunk",
                              ["pool"], buckets=_LATENCY, registry=registry)
        self.itl = Histogram("router_inter_token_latency_seconds", "Gap between streamed chunks",
                             ["pool"], buckets=_ITL, registry=registry)
        self.prompt_tokens = Counter("router_prompt_tokens_total", "Prompt tokens reported by backends",
                                     ["pool"], registry=registry)
        self.completion_tokens = Counter("router_completion_tokens_total", "Completion tokens reported by backends",
                                         ["pool"], registry=registry)
        self.backend_up = Gauge("router_backend_up", "1 when the backend is healthy and not ejected (on trial counts)",
                                ["pool", "backend"], registry=registry)
        self.backend_state = Gauge("router_backend_state",
                                   "1 for the backend's current state: up, down (health probes), ejected, trial",
                                   ["pool", "backend", "state"], registry=registry)
        self.ejections = Counter("router_backend_ejections_total",
                                 "Passive ejections after consecutive failures, by the last failure's kind",
                                 ["pool", "backend", "reason"], registry=registry)
        self.threshold = Gauge("router_threshold", "Configured routing threshold", registry=registry)
        self.upstream_errors = Counter("router_upstream_errors_total", "Transport failures talking to a backend",
                                       ["backend", "kind"], registry=registry)
        self.disconnects = Counter("router_client_disconnects_total", "Clients that went away before the end",
                                   ["pool"], registry=registry)
        self.retries = Counter("router_retries_total", "Requests retried on another backend before the first byte",
                               ["pool"], registry=registry)
        self.reported_load = Gauge("router_backend_reported_load",
                                   "Running + waiting requests a backend reported on /v1/loads (-1: none)",
                                   ["pool", "backend"], registry=registry)
        self.health_probes = Counter("router_health_probes_total", "Active health probes by outcome",
                                     ["backend", "result"], registry=registry)
        self.discovery_failures = Counter("router_discovery_failures_total",
                                          "DNS re-resolutions of a pool entry that failed or returned no address",
                                          ["pool"], registry=registry)
        self.k8s_errors = Counter("router_k8s_discovery_errors_total",
                                  "Reads of an InferencePool or its pods that failed (the last known backends are "
                                  "kept), by reason: unauthorized, forbidden, not_found, http_error, unreachable, "
                                  "bad_answer", ["inference_pool", "reason"], registry=registry)
        self.backends = Gauge("router_backends", "Backends currently configured or discovered per pool",
                              ["pool"], registry=registry)
        self.upstream_wait = Histogram("router_upstream_wait_seconds",
                                       "Time requests waited for a place under max_connections_per_backend "
                                       "(only requests that waited)", ["pool"], buckets=_LATENCY, registry=registry)
        self.upstream_waiting = Gauge("router_upstream_waiting_requests",
                                      "Requests waiting now for a place under max_connections_per_backend",
                                      ["pool", "backend"], registry=registry)
        # Prefix affinity (router.affinity): why each instance was chosen, and the cached share of prompts,
        # expected by the router (its index, its token estimate) and reported by backends (usage cached_tokens).
        self.prefix_decisions = Counter("router_prefix_decisions_total",
                                        "Prefix-affinity outcome of each decision, by pool and reason",
                                        ["pool", "reason"], registry=registry)
        self.prefix_prompt_tokens = Counter("router_prefix_prompt_tokens_total",
                                            "Prompt tokens of hashed requests, as the router estimates them",
                                            ["pool"], registry=registry)
        self.prefix_expected_cached = Counter("router_prefix_expected_cached_tokens_total",
                                              "Prompt tokens the router expected the chosen backend to hold",
                                              ["pool"], registry=registry)
        self.cached_tokens = Counter("router_cached_tokens_total",
                                     "Cached prompt tokens backends reported (usage prompt_tokens_details)",
                                     ["pool"], registry=registry)
        self.cache_reported_prompt_tokens = Counter(
            "router_cache_reported_prompt_tokens_total",
            "Prompt tokens of the answers that reported cached_tokens (the share's denominator)",
            ["pool"], registry=registry)
        self.prefix_blocks = Gauge("router_prefix_index_blocks", "Prompt blocks the router's prefix index "
                                   "holds for a backend", ["pool", "backend"], registry=registry)
        # Latency targets (router.slo, router.core.latency): label values are the configured tiers and "none".
        self.slo_requests = Counter("router_slo_requests_total",
                                    "Requests with latency targets by tier and outcome: met (every target measured "
                                    "met), missed, shed (429), unmeasured (no target could be measured)",
                                    ["tier", "result"], registry=registry)
        self.slo_targets = Counter("router_slo_targets_total", "Latency targets measured met or missed, by tier and "
                                   "kind (ttft, tpot)", ["tier", "kind", "result"], registry=registry)
        self.slo_prediction = Histogram("router_slo_prediction_ratio", "Predicted over measured latency of requests "
                                        "with targets, by kind (ttft, tpot) and pool: drift shows as a move off 1",
                                        ["kind", "pool"], buckets=_RATIO, registry=registry)
        # A learning policy's model per pool, read from Policy.state() once per scrape.
        self.policy_gauges = PolicyGauges(registry)
        # Children the hot path touches per chunk, looked up once (labels() takes a lock and builds a key).
        self.ttft_by_pool = {p: self.ttft.labels(p) for p in POOLS}
        self.itl_by_pool = {p: self.itl.labels(p) for p in POOLS}
        self._children: dict[tuple, object] = {}

    def child(self, metric, *values: str):
        """metric.labels(*values), looked up once per label set (the per-request path calls this)."""
        key = (id(metric), values)
        got = self._children.get(key)
        if got is None:
            got = self._children[key] = metric.labels(*values)
        return got

    def decided(self, decision, placement) -> None:
        """One routing decision (router.policy.Decision) and its prefix placement (router.core.plugins.Placement,
        None without prefix routing), as both front ends count it."""
        self.child(self.decisions, decision.pool, decision.reason).inc()
        if placement is not None:
            self.child(self.prefix_decisions, decision.pool, placement.reason).inc()
            if placement.prompt.hashed:
                self.child(self.prefix_prompt_tokens, decision.pool).inc(placement.prompt_tokens)
                self.child(self.prefix_expected_cached, decision.pool).inc(placement.expected_cached)


    def slo_shed(self, tier: str) -> None:
        self.child(self.slo_requests, tier, SHED).inc()

    def slo_done(self, tier: str, targets, forecast, obs) -> None:
        """A request with `targets` (router.core.latency.Targets) ended on a backend predicted at `forecast`
        (Forecast) with `obs` (router.observe.Observation): each target measured met or missed, the prediction
        against the measurement; once per request (the exchange's last lease). Not finished (an error, the
        client gone): not counted."""
        if not obs.ok:
            return
        measured: dict[str, float | None] = {"ttft": obs.ttft_s, "tpot": None}
        tokens = obs.tokens()
        if obs.ttft_s is not None and tokens is not None and tokens > 1 and obs.duration_s > obs.ttft_s:
            measured["tpot"] = (obs.duration_s - obs.ttft_s) / (tokens - 1)
        wanted = {"ttft": targets.ttft_s, "tpot": targets.tpot_s}
        predicted = {"ttft": forecast.ttft_s, "tpot": forecast.tpot_s}
        outcome = None
        for kind in SLO_KINDS:
            got = measured[kind]
            if got is None or got <= 0:
                continue
            self.child(self.slo_prediction, kind, obs.pool).observe(predicted[kind] / got)
            if wanted[kind] is None:
                continue
            ok = got <= wanted[kind]
            self.child(self.slo_targets, tier, kind, MET if ok else MISSED).inc()
            outcome = MISSED if not ok or outcome == MISSED else MET
        self.child(self.slo_requests, tier, outcome or UNMEASURED).inc()


# The gauges a learning policy exports per pool: name, help, and the key of its state()["pools"][pool] they read.
POLICY_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("router_adaptive_alpha_seconds", "Fitted seconds per token of a request running alone", "alpha_s"),
    ("router_adaptive_beta_seconds", "Fitted seconds per token added by each other running request", "beta_s"),
    ("router_adaptive_predicted_tokens_per_second",
     "Output tok/s the learned model predicts for the pool at its current load", "predicted_tok_s"),
    ("router_adaptive_model_error_ratio",
     "Mean relative error of the model's prediction against each new measurement", "error"),
    ("router_adaptive_samples", "Measurements folded into the pool's model", "samples"),
    ("router_adaptive_accept_length",
     "Mean accept length the pool's backends last reported on /v1/loads (0: none)", "accept_length"),
)


class PolicyGauges:
    """The POLICY_GAUGES, collected at scrape time from one call of `read` (bound by router.exporter to the
    policy's state()): a pool without members, or a policy that learns nothing, has no samples."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.read: Callable[[], dict | None] = lambda: None
        registry.register(self)

    def describe(self) -> Iterator[GaugeMetricFamily]:
        for name, doc, _ in POLICY_GAUGES:
            yield GaugeMetricFamily(name, doc, labels=["pool"])

    def collect(self) -> Iterator[GaugeMetricFamily]:
        state = self.read() or {}
        pools = state.get("pools") or {}
        for name, doc, key in POLICY_GAUGES:
            family = GaugeMetricFamily(name, doc, labels=["pool"])
            for pool, figures in pools.items():
                if key in figures:
                    family.add_metric([pool], float(figures[key]))
            yield family
