"""The router's one configuration model: YAML file, then ROUTER_* environment, then CLI flags; the only reader of os.environ."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, EnvSettingsSource, NoDecode, SettingsConfigDict, SettingsError

from router.curves import parse_curve
from router.outlier import OutlierConfig

# Old names still taken (YAML keys, ROUTER_* variables, load_settings overrides), each for the setting it became:
# adaptive_max_running feeds the prefix scorer too (router.core.figures), so it lost its policy prefix.
OLD_NAMES = {"adaptive_max_running": "max_running_requests"}

PolicyName = Literal["spillover", "global", "least-inflight", "round-robin", "balanced", "adaptive"]
ENV_PREFIX = "ROUTER_"


class ConfigError(Exception):
    """A user-caused configuration problem; its message is one line naming the problem."""


def _split_urls(value: Any) -> Any:
    # Env vars and flags give a comma-separated string; YAML gives a list.
    if value is None:
        return []
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            return json.loads(value)
        except ValueError:
            raise ValueError("backend list is not valid JSON") from None
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


def _check_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"bad backend URL {url!r} (expected http://HOST:PORT)")
    try:
        parts.port  # noqa: B018 - raises on a non-numeric port
    except ValueError as exc:
        raise ValueError(f"bad backend URL {url!r}: {exc}") from None
    if parts.username or parts.password:
        # Backend URLs end up in response headers and metric labels: no credentials in them.
        raise ValueError(f"backend URL for host {parts.hostname!r} must not carry credentials; use *_api_key")
    if parts.query or parts.fragment:
        raise ValueError(f"bad backend URL {url!r}: no query or fragment allowed")
    return url.rstrip("/")


UrlList = Annotated[list[str], NoDecode]

# Kubernetes object names (DNS-1123 subdomain), namespaces (DNS-1123 label) and label keys ([prefix/]name).
_K8S_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_K8S_NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_POOL_NAMES = ("speculative", "baseline")


def parse_pool_ref(entry: str) -> tuple[str | None, str, str | None]:
    """`[NAMESPACE/]NAME[=POOL]` -> (namespace or None, name, pool or None); ValueError names what is wrong."""
    ref, _, pool = entry.strip().partition("=")
    namespace, _, name = ref.rpartition("/")
    if not _K8S_NAME.match(name) or (namespace and not _K8S_NAMESPACE.match(namespace)):
        raise ValueError(f"bad InferencePool {entry!r} (expected [NAMESPACE/]NAME[=POOL], lowercase DNS names)")
    if pool and pool not in _POOL_NAMES:
        raise ValueError(f"InferencePool {entry!r}: pool must be speculative or baseline")
    if "=" in entry and not pool:
        raise ValueError(f"InferencePool {entry!r}: nothing after =")
    return namespace or None, name, pool or None


def _pool_ref_text(entry: dict[str, Any]) -> str:
    unknown = set(entry) - {"name", "namespace", "pool"}
    if unknown or not isinstance(entry.get("name"), str):
        raise ValueError(f"an InferencePool mapping takes name, namespace and pool, got {sorted(entry)}")
    text = f"{entry['namespace']}/{entry['name']}" if entry.get("namespace") else entry["name"]
    return f"{text}={entry['pool']}" if entry.get("pool") else text
CurveSetting = Annotated[tuple[tuple[float, float], ...] | None, NoDecode]


def _split_curve(value: Any) -> Any:
    # Env vars and flags give "1:77.5,2:125.1,..." (or JSON); YAML gives a list of [c, tok_s] pairs.
    if not isinstance(value, str):
        return value
    text = value.strip()
    if not text:
        return None
    if text.startswith("["):
        try:
            return json.loads(text)
        except ValueError:
            raise ValueError("curve is not valid JSON") from None
    return list(parse_curve(text))


def _check_curve(points: tuple[tuple[float, float], ...] | None) -> tuple[tuple[float, float], ...] | None:
    if points is None:
        return None
    if len(points) < 2:
        raise ValueError("a curve needs at least 2 points CONCURRENCY:TOK_S")
    for c, tok in points:
        if c <= 0 or tok <= 0:
            raise ValueError(f"curve point {c:g}:{tok:g}: concurrency and tok/s must be positive")
    if any(b[0] <= a[0] for a, b in zip(points, points[1:], strict=False)):
        raise ValueError("curve concurrencies must increase")
    return points


class SloTier(BaseModel):
    """One service tier's latency targets (router.slo): milliseconds to the first token and per output token after
    it (None: no target of that kind), and whether a request of the tier is shed (429) when no backend can meet
    them (else it goes where it misses least)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ttft_ms: float | None = Field(None, gt=0, allow_inf_nan=False)
    tpot_ms: float | None = Field(None, gt=0, allow_inf_nan=False)
    sheddable: bool = False


# The service tiers OpenAI's SDKs send (`service_tier`) and what they ask of the router by default (docs/ROUTER.md
# "Latency targets"): `default` and `auto` have no targets (routed by the policy, as without a tier).
DEFAULT_SLO_TIERS: dict[str, SloTier] = {
    "priority": SloTier(ttft_ms=2000, tpot_ms=30),
    "default": SloTier(),
    "auto": SloTier(),
    "flex": SloTier(ttft_ms=30000, tpot_ms=100, sheddable=True),
}


class Settings(BaseSettings):
    """Every router setting. Field names are the YAML keys, the ROUTER_<NAME> env vars and the --flags."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", validate_default=True)

    speculative: UrlList = Field(default_factory=list, description="backend URLs of the speculative (EAGLE-3) pool")
    baseline: UrlList = Field(default_factory=list, description="backend URLs of the baseline pool")
    speculative_api_key: SecretStr | None = Field(None, description="key sent as Bearer to speculative backends")
    baseline_api_key: SecretStr | None = Field(None, description="key sent as Bearer to baseline backends")

    policy: PolicyName = Field("spillover", description="routing policy")
    threshold: int = Field(32, ge=0, description="spillover: in-flight per speculative instance; global: total in-flight")
    hysteresis: int = Field(0, ge=0, description="global policy: go back to speculative only below threshold - hysteresis")

    speculative_curve: CurveSetting = Field(
        None, description="balanced policy: measured output tok/s of ONE speculative instance vs concurrency, "
        "\"1:77.5,2:125.1,...\" (YAML: list of [c, tok_s]); `spec-bench calibrate` prints it")
    baseline_curve: CurveSetting = Field(
        None, description="balanced policy: the same for ONE baseline instance")

    objective: Literal["throughput", "latency"] = Field(
        "latency", description="adaptive policy: latency (each request where it alone would be fastest, the "
        "balanced rule; measured the better of the two) or throughput (equal marginal gains, the optimum of an "
        "exact model, but marginal gains amplify the model's errors)")
    adaptive_forgetting: float = Field(
        0.99, gt=0.5, le=1.0, description="adaptive policy: weight kept by the past at each sample "
        "(0.99: about the last 100 samples count; 1: never forget); a server whose requests scatter widely "
        "(spread above 0.3) is forgotten more slowly, up to 0.998 (docs/ROUTER.md)")
    adaptive_explore: float = Field(
        0.03, ge=0.0, le=0.5, description="adaptive policy: share of decisions that may go to the other pool "
        "to keep its model fresh, only where that costs little")
    adaptive_deadband: float = Field(
        0.01, ge=0.0, lt=1.0, description="adaptive policy: relative change of a fitted model before routing "
        "follows it (keeps noise from flipping decisions)")
    max_running_requests: int | None = Field(
        None, ge=1, description="requests one backend runs at once (SGLang max_running_requests), beyond which "
        "requests queue: the adaptive policy takes it in place of what /v1/loads reports, the prefix scorer for "
        "a backend that reports none. Default: from /v1/loads, else inferred (adaptive) or unbounded. Old name: "
        "adaptive_max_running")

    prefix_routing: bool = Field(
        True, description="cache-aware routing: choose the instance of a pool by expected time to first token "
        "(its load plus the prefill of the prompt it does not hold, from the router's prefix index), and keep a "
        "conversation in the pool holding its prefix unless moving gains more than the re-prefill costs; "
        "false: least loaded, prefixes ignored")
    prefix_cross_pool: bool = Field(
        False, description="prefix routing: also weigh the re-prefill when the policy switches pools (false, "
        "the default until a run shows it pays: only the instance inside the policy's pool is chosen by "
        "prefix; docs/BENCH.md measured no gain and a worse E2E p90)")
    prefix_block_bytes: int = Field(
        1024, ge=64, le=65536, description="prefix index block: bytes of the prompt's JSON per hashed block "
        "(1024: ~256 tokens)")
    prefix_capacity_tokens: int = Field(
        1_000_000, ge=1000, description="prefix index bound per backend, in tokens, when its /v1/loads does "
        "not report max_total_num_tokens (load_signal backend)")

    slo_tiers: dict[str, SloTier] = Field(
        default_factory=lambda: dict(DEFAULT_SLO_TIERS), description="latency targets of each `service_tier` a "
        "request may name (YAML: tier: {ttft_ms, tpot_ms, sheddable}; env/flag: JSON); replaces the default "
        "mapping (priority 2000/30 ms, default and auto none, flex 30000/100 ms sheddable) as a whole; a tier "
        "not listed is a 400")

    load_signal: Literal["local", "backend"] = Field(
        "local", description="local: this router's own in-flight counts; backend: also poll each backend's "
        "/v1/loads (running + waiting), for several router replicas in front of the same backends")
    load_interval: float = Field(1.0, gt=0, description="seconds between /v1/loads polls (load_signal backend)")

    discovery: Literal["off", "dns"] = Field(
        "off", description="dns: a backend entry whose host is a DNS name (a headless Service) becomes one backend "
        "per address it resolves to, re-resolved every discovery_interval; off: entries are used as given")
    discovery_interval: float = Field(10.0, gt=0, description="seconds between DNS re-resolutions (discovery dns)")

    host: str = Field("127.0.0.1", description="listen address")
    port: int = Field(8000, ge=0, le=65535, description="listen port (0 picks a free one)")
    metrics_host: str | None = Field(None, description="serve /metrics only on this separate address")
    metrics_port: int | None = Field(None, ge=0, le=65535, description="port for the separate /metrics listener")
    api_key: SecretStr | None = Field(None, description="clients must send Authorization: Bearer KEY")
    served_model_name: str | None = Field(None, description="model id /v1/models advertises instead of the backends' list")

    connect_timeout: float = Field(5.0, gt=0, description="seconds to open a backend connection")
    first_byte_timeout: float = Field(300.0, gt=0, description="seconds until the backend's first body byte")
    idle_timeout: float = Field(60.0, gt=0, description="longest gap between streamed chunks, seconds")
    write_timeout: float = Field(10.0, gt=0, description="seconds a write to a client may stall (it reads "
                                 "nothing); then its connection is closed and counted as a disconnect")
    write_buffer_bytes: int = Field(2 * 1024 * 1024, ge=65536, description="answer bytes held for a client that "
                                    "reads slower than the backend writes; above it the backend's stream waits")
    retries: int = Field(1, ge=0, le=3, description="retries on another backend before the first byte")

    health_interval: float = Field(5.0, gt=0, description="seconds between active /health probes")
    health_path: str = Field("/health", pattern=r"^/[^?#\s]*$", description="path the active probe GETs; 200 means "
                             "up (SGLang and llama.cpp's llama-server: /health; llama-cpp-python's server has none: "
                             "/openapi.json, which answers without waiting for the model)")
    health_timeout: float = Field(5.0, gt=0, description="seconds a probe may take")
    health_failure_threshold: int = Field(3, ge=1, description="failed probes in a row that mark a backend down")
    health_success_threshold: int = Field(2, ge=1, description="good probes in a row that mark it up again")

    eject_consecutive_errors: int = Field(
        5, ge=0, description="5xx answers or connection failures in a row that eject a backend (0: never eject; "
        "4xx, client disconnects and the router's own errors do not count)")
    eject_base_seconds: float = Field(5.0, gt=0, description="first ejection's length; each repeated one doubles")
    eject_max_seconds: float = Field(60.0, gt=0, description="longest ejection; after this long fully back, "
                                     "the next ejection is short again")
    eject_trial_requests: int = Field(3, ge=1, description="after an ejection: requests let through at a time, "
                                      "and successes in a row needed to be fully back")

    drain_timeout: float = Field(30.0, ge=0, description="on SIGTERM, seconds in-flight requests may finish")
    client_timeout: float = Field(60.0, gt=0, description="seconds a client may take to send its request "
                                  "(408 above); an idle client connection is closed after it too")
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1, description="largest request body accepted (413 above)")
    max_header_bytes: int = Field(8190, ge=256, description="largest request line / header field")
    max_headers: int = Field(100, ge=8, description="most request headers accepted")
    max_connections: int = Field(4096, ge=1, description="open connections to all backends together")
    max_connections_per_backend: int = Field(1024, ge=1, description="requests open to one backend at once; "
                                             "more wait in the router (router_upstream_waiting_requests)")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="log level")

    epp_port: int = Field(9002, ge=0, le=65535, description="spec-router epp: gRPC port of the Gateway API "
                          "endpoint picker (ext_proc and gRPC health), on host (0 picks a free one)")
    epp_endpoints: int = Field(1, ge=1, le=8, description="spec-router epp: endpoints named per request, the "
                               "picked one first, then fallbacks in retry order (Envoy's ORIGINAL_DST cluster "
                               "reads one)")
    epp_response_body: Literal["stream", "none"] = Field(
        "stream", description="spec-router epp: what it reads of each response. stream: every body chunk, full "
        "duplex (deploy/envoy/envoy.yaml): first token, usage and [DONE] feed the learned speeds; it costs a gRPC "
        "round trip through the picker per chunk. none: the response headers and the end of the ext_proc stream "
        "only (deploy/envoy/envoy-headers.yaml): 2 messages fewer per request, but no time to first token and no "
        "token counts, so the adaptive policy's speeds and the prefill figures stay unlearned, and a stream cut "
        "mid-way ends as a success. Envoy's own report of its body mode wins over this (docs/DEPLOY.md)")

    # InferencePool discovery (router.k8s): the Gateway API Inference Extension's pool of model servers, read from
    # the Kubernetes API; docs/DEPLOY.md, "Backends from the InferencePool".
    k8s_inference_pools: UrlList = Field(
        default_factory=list, json_schema_extra={"metavar": "[NS/]NAME[=POOL]"},
        description="InferencePools whose ready pods are backends, each "
        "[NAMESPACE/]NAME[=POOL] (YAML: also {name, namespace, pool}); without =POOL each pod's k8s_pool_label "
        "names its pool (speculative or baseline)")
    k8s_namespace: str | None = Field(None, description="namespace of the k8s_inference_pools entries that name "
                                      "none (in a pod: the downward API's metadata.namespace)")
    k8s_pool_label: str = Field("app.kubernetes.io/component", description="pod label whose value (speculative "
                                "or baseline) puts the pod in that pool, for an InferencePool given without =POOL")
    k8s_api: str | None = Field(None, json_schema_extra={"metavar": "URL"}, description="URL of the Kubernetes "
                                "API (default in a pod: https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT)")
    k8s_token_file: str = Field("/var/run/secrets/kubernetes.io/serviceaccount/token",
                                json_schema_extra={"metavar": "FILE"}, description="bearer "
                                "token for the Kubernetes API, re-read every round (none sent when absent)")
    k8s_ca_file: str = Field("/var/run/secrets/kubernetes.io/serviceaccount/ca.crt",
                             json_schema_extra={"metavar": "FILE"}, description="CA bundle "
                             "that signed the Kubernetes API's certificate (system CAs when absent)")
    k8s_interval: float = Field(5.0, gt=0, description="seconds between reads of the InferencePools and their "
                                "pods")

    @field_validator("speculative", "baseline", mode="before")
    @classmethod
    def _urls(cls, value: Any) -> Any:
        return _split_urls(value)

    @field_validator("speculative", "baseline")
    @classmethod
    def _valid_urls(cls, value: list[str]) -> list[str]:
        urls = [_check_url(u) for u in value]
        if len(set(urls)) != len(urls):
            raise ValueError("a backend URL is listed twice")
        return urls

    @field_validator("k8s_inference_pools", mode="before")
    @classmethod
    def _pool_refs_in(cls, value: Any) -> Any:
        # YAML may give mappings {name, namespace, pool}: the same entry as NAMESPACE/NAME=POOL.
        value = _split_urls(value)
        if isinstance(value, list):
            return [_pool_ref_text(v) if isinstance(v, dict) else v for v in value]
        return value

    @field_validator("k8s_inference_pools")
    @classmethod
    def _valid_pool_refs(cls, value: list[str]) -> list[str]:
        for entry in value:
            parse_pool_ref(entry)
        if len(set(value)) != len(value):
            raise ValueError("an InferencePool is listed twice")
        return value

    @field_validator("k8s_api")
    @classmethod
    def _valid_k8s_api(cls, value: str | None) -> str | None:
        return None if value is None else _check_url(value)

    @field_validator("slo_tiers", mode="before")
    @classmethod
    def _tiers_in(cls, value: Any) -> Any:
        # A flag gives JSON text; YAML and the environment (pydantic-settings parses it) give a mapping.
        if isinstance(value, str):
            try:
                return json.loads(value)
            except ValueError:
                raise ValueError("slo_tiers is not valid JSON (expected {\"TIER\": {\"ttft_ms\": N, ...}})") from None
        return value

    @field_validator("speculative_curve", "baseline_curve", mode="before")
    @classmethod
    def _curve_in(cls, value: Any) -> Any:
        return _split_curve(value)

    @field_validator("speculative_curve", "baseline_curve")
    @classmethod
    def _valid_curve(cls, value: tuple[tuple[float, float], ...] | None) -> tuple[tuple[float, float], ...] | None:
        return _check_curve(value)

    def curves(self) -> tuple[tuple[tuple[float, float], ...], tuple[tuple[float, float], ...]] | None:
        """(speculative, baseline) curves when both are set, for the balanced policy."""
        if self.speculative_curve is None or self.baseline_curve is None:
            return None
        return self.speculative_curve, self.baseline_curve

    def _check_k8s(self) -> None:
        if self.discovery == "dns":
            # Two discoveries could list one address and each remove it while the other still lists it.
            raise ValueError("k8s_inference_pools and discovery dns: choose one")
        if self.k8s_api is None:
            raise ValueError("k8s_inference_pools needs k8s_api, the Kubernetes API's URL (in a pod it comes "
                             "from KUBERNETES_SERVICE_HOST)")
        if self.k8s_namespace is None and any(parse_pool_ref(e)[0] is None for e in self.k8s_inference_pools):
            raise ValueError("k8s_inference_pools entry without NAMESPACE/ needs k8s_namespace")
        if not _LABEL_KEY.match(self.k8s_pool_label):
            raise ValueError(f"k8s_pool_label {self.k8s_pool_label!r} is not a Kubernetes label key")

    def outlier(self) -> OutlierConfig:
        return OutlierConfig(self.eject_consecutive_errors, self.eject_base_seconds, self.eject_max_seconds,
                             self.eject_trial_requests)

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        if not self.speculative and not self.baseline and not self.k8s_inference_pools:
            raise ValueError("no backend configured: give --speculative URL and/or --baseline URL")
        if self.k8s_inference_pools:
            self._check_k8s()
        both = set(self.speculative) & set(self.baseline)
        if both:
            raise ValueError(f"backend {sorted(both)[0]} is in both pools")
        if (self.metrics_host is None) != (self.metrics_port is None):
            raise ValueError("metrics_host and metrics_port go together")
        if self.eject_max_seconds < self.eject_base_seconds:
            raise ValueError("eject_max_seconds must be at least eject_base_seconds")
        if self.policy == "balanced" and self.curves() is None:
            raise ValueError("policy balanced needs speculative_curve and baseline_curve "
                             "(measured tok/s per instance; `spec-bench calibrate` prints both)")
        return self


def _read_yaml(path: str) -> dict[str, Any]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" line {where.line + 1}" if where is not None else ""
        raise ConfigError(f"config file {path}{line} is not valid YAML") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of settings")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def describe(exc: ValidationError, origin: dict[str, str] | None = None) -> str:
    """One line naming the first problem of a validation error, and where the value came from when known
    (`threshold (env ROUTER_THRESHOLD): ...`)."""
    err = exc.errors()[0]
    loc = [str(p) for p in err.get("loc", ()) if not isinstance(p, int)]
    where = ".".join(loc)
    if loc and origin and loc[0] in origin:
        where += f" ({origin[loc[0]]})"
    msg = err.get("msg", "invalid value").removeprefix("Value error, ")
    if err.get("type") == "extra_forbidden":
        msg = "unknown setting"
    return f"{where}: {msg}" if where else msg


def _new_names(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """One layer's values (YAML, ROUTER_* variables, flags) with each old name (OLD_NAMES) turned into the new one,
    before the layers merge: a later layer's new name overrides an earlier layer's old one."""
    for old, new in OLD_NAMES.items():
        old_key = next((k for k in values if k.upper() == (prefix + old).upper()), None)
        if old_key is None:
            continue
        values = dict(values)
        value = values.pop(old_key)
        new_key = next((k for k in values if k.upper() == (prefix + new).upper()), prefix + new.upper() if prefix
                       else new)
        if values.setdefault(new_key, value) != value:
            raise ConfigError(f"{prefix}{old.upper() if prefix else old} is the old name of "
                              f"{prefix}{new.upper() if prefix else new}: give one of them")
    return values


def load_settings(config_file: str | None = None, overrides: dict[str, Any] | None = None,
                  environ: dict[str, str] | None = None) -> Settings:
    """Layer YAML < ROUTER_* env < overrides (flags); raise ConfigError with a one-line message."""
    env = dict(os.environ if environ is None else environ)
    path = config_file or env.get(ENV_PREFIX + "CONFIG")
    data: dict[str, Any] = _read_yaml(path) if path else {}
    env_values = {k: v for k, v in env.items() if k.startswith(ENV_PREFIX) and k != ENV_PREFIX + "CONFIG"}
    env_values = _new_names(env_values, ENV_PREFIX)
    data = _new_names(data)
    # Where each setting's value came from, so an error names what the user must fix (the variable, the flag).
    origin = {k: f"config file {path}" for k in data}
    try:
        source = EnvSettingsSource(Settings, case_sensitive=False, env_prefix=ENV_PREFIX)
        source.env_vars = {k.lower(): v for k, v in env_values.items()}
        from_env = source()
        data.update(from_env)
        origin.update({k: f"env {ENV_PREFIX}{k.upper()}" for k in from_env})
        flags = _new_names({k: v for k, v in (overrides or {}).items() if v is not None})
        data.update(flags)
        origin.update({k: "--" + k.replace("_", "-") for k in flags})
        if data.get("k8s_inference_pools") and not data.get("k8s_api") and env.get("KUBERNETES_SERVICE_HOST"):
            # In a pod: the API server's address as the kubelet gives it to every container.
            host = env["KUBERNETES_SERVICE_HOST"]
            data["k8s_api"] = (f"https://{f'[{host}]' if ':' in host else host}:"
                               f"{env.get('KUBERNETES_SERVICE_PORT', '443')}")
        # Only init values are used: the environment was read above, from `env`, exactly once.
        return Settings.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(describe(exc, origin)) from None
    except SettingsError as exc:
        raise ConfigError(str(exc).splitlines()[0]) from None
