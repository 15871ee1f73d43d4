"""InferencePool discovery (router.k8s) against a fake Kubernetes API on 127.0.0.1 serving recorded-shape objects
(tests/fixtures/k8s): ready pods join the pool their label names, pods that leave drain, a failing API keeps the
last known backends; the proxy and the picker both use it. Tested on these fixtures, not on a live cluster."""
from __future__ import annotations

import asyncio
import copy
import json
import logging
import shutil
import ssl
import subprocess
from pathlib import Path

import aiohttp
import jsonschema
import kubernetes_validate
import openai
import pytest
import yaml
from aiohttp import web
from prometheus_client import CollectorRegistry

from router import exporter
from router.__main__ import parse_command
from router.app import build_discovery, build_pools
from router.discovery import BackendDiscovery
from router.k8s import ApiError, InferencePoolDiscovery, pod_address, pool_spec
from router.metrics import Metrics
from router.settings import ConfigError, load_settings
from tests.fixtures_epp import need_epp
from tests.fixtures_router import poll

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "k8s"
CRD = ROOT / "deploy" / "k8s" / "crds" / "inferencepools.yaml"
NS, NAME = "spec-router", "spec-router"
REF = f"{NS}/{NAME}"
TOKEN = "eyJhbGciOiJSUzI1NiJ9.test-token"
SPEC_READY, SPEC_UNREADY = "sglang-speculative-7c9d8b5f4-x2k9p", "sglang-speculative-7c9d8b5f4-m7q4t"
BASE_READY, BASE_TERMINATING = "sglang-baseline-5f6b7d9c8-h3w8z", "sglang-baseline-5f6b7d9c8-t8p6j"
CANARY = "sglang-canary-6d8f9a7b5-q9z3k"


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text(encoding="utf-8"))


def _status(code: int, reason: str, message: str) -> web.Response:
    # The API server's refusal: a Status object.
    body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}
    return web.json_response(body, status=code)


class FakeApi:
    """The two reads the discovery makes, answered from objects the test edits while it runs."""

    def __init__(self, token: str | None = TOKEN) -> None:
        self.token = token
        self.inference_pools: dict[tuple[str, str], dict] = {(NS, NAME): fixture("inferencepool.json")}
        self.pods: dict[str, list[dict]] = {NS: fixture("pods.json")["items"]}
        self.refuse: int | None = None  # answer every request with this status
        self.bad_pod_list = False
        self.requests: list[tuple[str, dict[str, str], str | None]] = []  # path, query, Authorization
        self.runner: web.AppRunner | None = None
        self.port = 0
        self.ssl: ssl.SSLContext | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.ssl else 'http'}://127.0.0.1:{self.port}"

    def pod(self, name: str) -> dict:
        return next(p for p in self.pods[NS] if p["metadata"]["name"] == name)

    async def _check(self, request: web.Request) -> web.Response | None:
        self.requests.append((request.path, dict(request.query), request.headers.get("Authorization")))
        if self.token is not None and request.headers.get("Authorization") != f"Bearer {self.token}":
            return _status(401, "Unauthorized", "Unauthorized")
        if self.refuse is not None:
            return _status(self.refuse, {403: "Forbidden"}.get(self.refuse, "InternalError"),
                           'inferencepools.inference.networking.k8s.io "spec-router" is forbidden: User '
                           '"system:serviceaccount:spec-router:default" cannot get resource "inferencepools"')
        return None

    async def _inference_pool(self, request: web.Request) -> web.Response:
        refused = await self._check(request)
        if refused is not None:
            return refused
        key = (request.match_info["ns"], request.match_info["name"])
        if key not in self.inference_pools:
            return _status(404, "NotFound", f'inferencepools.inference.networking.k8s.io "{key[1]}" not found')
        return web.json_response(self.inference_pools[key])

    async def _pods(self, request: web.Request) -> web.Response:
        refused = await self._check(request)
        if refused is not None:
            return refused
        if self.bad_pod_list:
            return web.json_response({"kind": "PodList", "apiVersion": "v1", "metadata": {}})
        wanted = dict(part.split("=", 1) for part in request.query.get("labelSelector", "").split(",") if part)
        items = [p for p in self.pods.get(request.match_info["ns"], [])
                 if all(p["metadata"].get("labels", {}).get(k) == v for k, v in wanted.items())]
        return web.json_response({"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "1"},
                                  "items": items})

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools/{name}",
                           self._inference_pool)
        app.router.add_get("/api/v1/namespaces/{ns}/pods", self._pods)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", self.port, ssl_context=self.ssl)
        await site.start()
        self.port = self.runner.addresses[0][1]

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


def set_ready(pod: dict, ready: bool) -> None:
    for c in pod["status"]["conditions"]:
        if c["type"] in ("Ready", "ContainersReady"):
            c["status"] = "True" if ready else "False"


def serve_pod(pod: dict, ip: str) -> None:
    """A fixture pod made Running and Ready at `ip`."""
    pod["status"].update(phase="Running", podIP=ip, podIPs=[{"ip": ip}])
    set_ready(pod, True)


@pytest.fixture
async def fake_api():
    apis: list[FakeApi] = []

    async def make(**kw) -> FakeApi:
        api = FakeApi(**kw)
        apis.append(api)
        await api.start()
        return api

    yield make
    for api in apis:
        await api.stop()


@pytest.fixture
def token_file(tmp_path) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")  # the kubelet's file may end in a newline
    return path


def k8s_settings(api: FakeApi, token_file: Path, entries: str = REF, **extra) -> dict:
    return {"k8s_inference_pools": entries, "k8s_api": api.url, "k8s_token_file": str(token_file),
            "k8s_ca_file": str(token_file.parent / "absent-ca.crt"), "health_timeout": 2.0, **extra}


@pytest.fixture
async def discovery_of():
    """`discovery_of(settings_dict)` -> (InferencePoolDiscovery on bare Pools, registry); stopped at teardown."""
    made: list[InferencePoolDiscovery] = []

    def make(values: dict):
        s = load_settings(None, values, environ={})
        registry = CollectorRegistry()
        metrics = Metrics(registry)
        pools = build_pools(s)
        exporter.bind(metrics, pools)
        d = build_discovery(pools, s, metrics)
        assert isinstance(d, InferencePoolDiscovery) and isinstance(d, BackendDiscovery)
        made.append(d)
        return d, registry

    yield make
    for d in made:
        await d.stop()


def members(d: InferencePoolDiscovery) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {"speculative": [], "baseline": []}
    for b in d.pools.backends:
        out[b.pool].append(b.url)
    return {p: sorted(u) for p, u in out.items()}


# ---------------------------------------------------------------- the fixtures are the API's shapes

def _crd_schema() -> dict:
    crd = yaml.safe_load(CRD.read_text(encoding="utf-8"))
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return version["schema"]["openAPIV3Schema"]


def test_inference_pool_fixture_validates_against_the_crd():
    obj = fixture("inferencepool.json")
    jsonschema.validate(obj, _crd_schema())
    broken = copy.deepcopy(obj)
    broken["spec"]["targetPorts"] = [{"number": 70000}]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, _crd_schema())


def test_pod_list_fixture_validates_against_the_pinned_kubernetes():
    pods = fixture("pods.json")
    kubernetes_validate.validate(pods, "1.32.0", strict=True)
    broken = copy.deepcopy(pods)
    broken["items"][0]["status"]["podIP"] = 10
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, "1.32.0", strict=True)


def test_selector_ports_and_ready_pods_of_the_fixtures():
    assert pool_spec(fixture("inferencepool.json")) == ("app.kubernetes.io/name=sglang", [30000])
    got = {p["metadata"]["name"]: pod_address(p) for p in fixture("pods.json")["items"]}
    assert got == {SPEC_READY: "10.42.0.11", SPEC_UNREADY: None, BASE_READY: "10.42.1.21",
                   "sglang-baseline-5f6b7d9c8-r5n2v": None,  # Pending, no IP
                   BASE_TERMINATING: None,  # still Ready, but terminating
                   CANARY: "10.42.2.31"}


@pytest.mark.parametrize("spec", [{}, {"selector": {"matchLabels": {}}, "targetPorts": [{"number": 1}]},
                                  {"selector": {"matchLabels": {"a": "b"}}},
                                  {"selector": {"matchLabels": {"a": "b"}}, "targetPorts": [{"number": "80"}]}])
def test_an_inference_pool_of_the_wrong_shape_is_a_bad_answer(spec):
    with pytest.raises(ApiError) as exc:
        pool_spec({"spec": spec})
    assert exc.value.reason == "bad_answer"


# ---------------------------------------------------------------- settings

def test_entries_in_every_form():
    base = {"k8s_api": "https://10.96.0.1:443"}
    s = load_settings(None, {**base, "k8s_inference_pools": "a/spec=speculative,b/base=baseline"}, environ={})
    assert s.k8s_inference_pools == ["a/spec=speculative", "b/base=baseline"]
    s = load_settings(None, {**base, "k8s_inference_pools": [{"name": "p", "namespace": "n", "pool": "baseline"},
                                                             "m/q"]}, environ={})
    assert s.k8s_inference_pools == ["n/p=baseline", "m/q"]
    s = load_settings(None, {}, environ={"ROUTER_K8S_INFERENCE_POOLS": "spec-router",
                                         "ROUTER_K8S_NAMESPACE": "llm",
                                         "KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "6443"})
    assert s.k8s_api == "https://[fd00::1]:6443" and s.speculative == [] and s.baseline == []
    # outside a pod, or when given, k8s_api is what the settings say
    s = load_settings(None, {"k8s_inference_pools": "n/p", "k8s_api": "http://127.0.0.1:8001"},
                      environ={"KUBERNETES_SERVICE_HOST": "10.96.0.1"})
    assert s.k8s_api == "http://127.0.0.1:8001"
    s = load_settings(None, {"speculative": "http://10.0.0.1:1"}, environ={"KUBERNETES_SERVICE_HOST": "10.96.0.1"})
    assert s.k8s_api is None, "no InferencePool, no API address"


@pytest.mark.parametrize(("values", "says"), [
    ({"k8s_inference_pools": "n/p"}, "needs k8s_api"),
    ({"k8s_inference_pools": "p", "k8s_api": "http://a:1"}, "needs k8s_namespace"),
    ({"k8s_inference_pools": "n/p=fast", "k8s_api": "http://a:1"}, "speculative or baseline"),
    ({"k8s_inference_pools": "n/p=", "k8s_api": "http://a:1"}, "nothing after ="),
    ({"k8s_inference_pools": "N/P", "k8s_api": "http://a:1"}, "lowercase"),
    ({"k8s_inference_pools": "n/p,n/p", "k8s_api": "http://a:1"}, "listed twice"),
    ({"k8s_inference_pools": [{"name": "p", "ns": "n"}], "k8s_api": "http://a:1"}, "name, namespace and pool"),
    ({"k8s_inference_pools": "n/p", "k8s_api": "ftp://a:1"}, "bad backend URL"),
    ({"k8s_inference_pools": "n/p", "k8s_api": "http://a:1", "k8s_interval": "0"}, "greater than 0"),
    ({"k8s_inference_pools": "n/p", "k8s_api": "http://a:1", "k8s_pool_label": "bad label"}, "label key"),
    ({"k8s_inference_pools": "n/p", "k8s_api": "http://a:1", "speculative": "http://svc:1", "discovery": "dns"},
     "choose one"),
])
def test_bad_k8s_settings_are_one_line_errors(values, says):
    with pytest.raises(ConfigError) as exc:
        load_settings(None, values, environ={})
    assert says in str(exc.value) and "\n" not in str(exc.value)


def test_cli_bad_inference_pool_is_one_line_and_exit_2(capsys, monkeypatch):
    for name in ("KUBERNETES_SERVICE_HOST", "ROUTER_K8S_API", "ROUTER_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as exc:
        parse_command(["epp", "--k8s-inference-pools", "spec-router/spec-router"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs k8s_api" in err
    command, s = parse_command(["epp", "--k8s-inference-pools", "spec-router/spec-router",
                                "--k8s-api", "http://127.0.0.1:8001"])
    assert command == "epp" and s.k8s_inference_pools == ["spec-router/spec-router"]


# ---------------------------------------------------------------- discovery on a bare Pools

async def test_ready_pods_join_the_pool_their_label_names(fake_api, token_file, discovery_of, caplog):
    api = await fake_api()
    d, registry = discovery_of(k8s_settings(api, token_file))
    caplog.set_level(logging.INFO, logger="router.k8s")
    await d.refresh()
    assert members(d) == {"speculative": ["http://10.42.0.11:30000"], "baseline": ["http://10.42.1.21:30000"]}
    # the requests: the pool, then its pods by its selector, each with the service account's token
    assert [(path, query) for path, query, _ in api.requests] == [
        (f"/apis/inference.networking.k8s.io/v1/namespaces/{NS}/inferencepools/{NAME}", {}),
        (f"/api/v1/namespaces/{NS}/pods", {"labelSelector": "app.kubernetes.io/name=sglang"})]
    assert {auth for _, _, auth in api.requests} == {f"Bearer {TOKEN}"}
    assert all(not b.healthy for b in d.pools.backends), "a newcomer carries no traffic before a probe"
    await d.refresh()
    canary = [r for r in caplog.records if CANARY in r.getMessage()]
    assert len(canary) == 1 and "not speculative or baseline" in canary[0].getMessage(), "warned once"
    assert registry.get_sample_value("router_backends", {"pool": "speculative"}) == 1


async def test_pods_that_turn_ready_leave_or_move_change_the_pools(fake_api, token_file, discovery_of):
    api = await fake_api()
    d, _ = discovery_of(k8s_settings(api, token_file))
    await d.refresh()
    spec_url, base_url = "http://10.42.0.11:30000", "http://10.42.1.21:30000"
    # the loading pod becomes Ready: it joins
    set_ready(api.pod(SPEC_UNREADY), True)
    await d.refresh()
    assert members(d)["speculative"] == [spec_url, "http://10.42.0.12:30000"]
    # a pod with a request in flight turns unready: no new traffic, its request finishes (drain, not cut)
    lease = d.pools.by_url[spec_url].lease()
    set_ready(api.pod(SPEC_READY), False)
    await d.refresh()
    assert spec_url not in d.pools.by_url and spec_url in d.pools.draining
    lease.release()
    assert d.pools.draining == {}
    # a pod deleted from the API: gone
    api.pods[NS].remove(api.pod(SPEC_UNREADY))
    await d.refresh()
    assert members(d)["speculative"] == []
    # a pod relabelled from baseline to speculative moves pools in one round
    api.pod(BASE_READY)["metadata"]["labels"]["app.kubernetes.io/component"] = "speculative"
    await d.refresh()
    assert members(d) == {"speculative": [base_url], "baseline": []}
    assert d.pools.by_url[base_url].pool == "speculative"
    # every pod gone (scaled to zero): the API's answer is authoritative, the pools empty
    api.pods[NS] = []
    await d.refresh()
    assert d.pools.backends == []


async def test_an_edited_inference_pool_is_followed(fake_api, token_file, discovery_of):
    api = await fake_api()
    d, _ = discovery_of(k8s_settings(api, token_file))
    await d.refresh()
    pool = api.inference_pools[(NS, NAME)]
    pool["spec"]["targetPorts"] = [{"number": 30000}, {"number": 30010}]
    pool["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] = "baseline"
    await d.refresh()
    assert api.requests[-1][1] == {"labelSelector": "app.kubernetes.io/component=baseline,"
                                                    "app.kubernetes.io/name=sglang"}
    assert members(d) == {"speculative": [], "baseline": ["http://10.42.1.21:30000", "http://10.42.1.21:30010"]}


async def test_an_entry_with_a_pool_puts_every_ready_pod_there(fake_api, token_file, discovery_of):
    api = await fake_api()
    d, _ = discovery_of(k8s_settings(api, token_file, entries=f"{REF}=baseline"))
    await d.refresh()
    assert members(d) == {"speculative": [], "baseline": ["http://10.42.0.11:30000", "http://10.42.1.21:30000",
                                                          "http://10.42.2.31:30000"]}


async def test_api_failures_keep_the_last_known_backends(fake_api, token_file, discovery_of, caplog):
    api = await fake_api()
    d, registry = discovery_of(k8s_settings(api, token_file))
    await d.refresh()
    known = members(d)
    caplog.set_level(logging.INFO, logger="router.k8s")
    caplog.clear()  # the first round's warning about the canary pod

    def errors(reason: str) -> float:
        return registry.get_sample_value("router_k8s_discovery_errors_total",
                                         {"inference_pool": REF, "reason": reason}) or 0.0

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]

    api.pods[NS] = []  # what the API would answer if it answered: it must not be applied
    token_file.write_text("a-token-the-api-does-not-know")
    for _ in range(2):
        await d.refresh()
    assert members(d) == known and errors("unauthorized") == 2
    assert len(warnings()) == 1 and "HTTP 401" in warnings()[0] and "keeping 2 known backend(s)" in warnings()[0]
    token_file.write_text(TOKEN)
    api.refuse = 403
    await d.refresh()
    assert errors("forbidden") == 1 and "cannot get resource" in warnings()[-1]
    api.refuse = None
    api.bad_pod_list = True
    await d.refresh()
    assert errors("bad_answer") == 1 and "without items" in warnings()[-1]
    api.bad_pod_list = False
    pool = api.inference_pools.pop((NS, NAME))
    await d.refresh()
    assert errors("not_found") == 1 and "not found" in warnings()[-1]
    api.inference_pools[(NS, NAME)] = pool
    await api.stop()  # the API server gone: connection refused
    await d.refresh()
    await d.refresh()
    assert errors("unreachable") == 2 and members(d) == known
    assert len(warnings()) == 5, "one line per change of state"
    await api.start()  # back on the same port, with its newest answer
    await d.refresh()
    assert members(d) == {"speculative": [], "baseline": []}
    assert "read: selector app.kubernetes.io/name=sglang" in caplog.records[-1].getMessage()


async def test_without_a_token_file_no_authorization_is_sent(fake_api, tmp_path, discovery_of, caplog):
    api = await fake_api(token=None)  # e.g. `kubectl proxy`, which adds its own credentials
    d, _ = discovery_of(k8s_settings(api, tmp_path / "no-token"))
    await d.refresh()
    await d.refresh()
    assert {auth for _, _, auth in api.requests} == {None}
    assert members(d)["baseline"] == ["http://10.42.1.21:30000"]
    assert len([r for r in caplog.records if "no token in" in r.getMessage()]) == 1


@pytest.fixture
def api_cert(tmp_path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key, as an API server's (its own CA)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = tmp_path / "api.crt", tmp_path / "api.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=kube",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=30)
    return cert, key


async def test_https_api_is_trusted_through_the_ca_file(token_file, api_cert, discovery_of):
    cert, key = api_cert
    api = FakeApi()
    api.ssl = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    api.ssl.load_cert_chain(cert, key)
    await api.start()
    try:
        d, registry = discovery_of(k8s_settings(api, token_file, k8s_ca_file=str(cert)))
        await d.refresh()
        assert members(d)["speculative"] == ["http://10.42.0.11:30000"]
        # without the CA (the file absent: the system's CAs) the certificate is not trusted
        untrusting, registry = discovery_of(k8s_settings(api, token_file))
        await untrusting.refresh()
        assert untrusting.pools.backends == []
        assert registry.get_sample_value("router_k8s_discovery_errors_total",
                                         {"inference_pool": REF, "reason": "unreachable"}) == 1
    finally:
        await api.stop()


# ---------------------------------------------------------------- the proxy and the picker on real simulators

def _one_pod_pools(api: FakeApi, spec_url: str, base_url: str) -> str:
    """Two InferencePools (one per pool) of one pod each at 127.0.0.1, on each simulator's port; the settings
    entries that name them."""
    for name, url in (("spec-pool", spec_url), ("base-pool", base_url)):
        pool = copy.deepcopy(api.inference_pools[(NS, NAME)])
        pool["metadata"]["name"] = name
        pool["spec"]["selector"]["matchLabels"] = {"pool": name}
        pool["spec"]["targetPorts"] = [{"number": int(url.rsplit(":", 1)[1])}]
        api.inference_pools[(NS, name)] = pool
    pods = []
    for name in ("spec-pool", "base-pool"):
        pod = copy.deepcopy(api.pod(SPEC_READY))
        pod["metadata"]["name"] = f"{name}-0"
        pod["metadata"]["labels"] = {"pool": name}
        serve_pod(pod, "127.0.0.1")
        pods.append(pod)
    api.pods[NS] = pods
    return f"{NS}/spec-pool=speculative,{NS}/base-pool=baseline"


async def _backend_of(client: openai.AsyncOpenAI) -> str:
    raw = await client.chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert raw.parse().choices[0].message.content
    return raw.headers["x-router-backend"]


async def test_the_proxy_routes_to_inference_pool_pods(fake_api, token_file, sim_factory, router_factory):
    spec, base = await sim_factory("eagle3-tp8"), await sim_factory("baseline-tp8")
    api = await fake_api()
    entries = _one_pod_pools(api, spec.url, base.url)
    router = await router_factory(**k8s_settings(api, token_file, entries=entries, k8s_interval=0.05))
    pools = router.state.pools
    assert {b.url: b.pool for b in pools.backends} == {spec.url: "speculative", base.url: "baseline"}
    async with openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=30) as client:
        assert await _backend_of(client) == spec.url  # spillover, idle: the speculative pool
        set_ready(api.pod("spec-pool-0"), False)
        assert await poll(lambda: spec.url not in pools.by_url, 5)
        assert await _backend_of(client) == base.url
        set_ready(api.pod("spec-pool-0"), True)
        assert await poll(lambda: spec.url in pools.by_url and pools.by_url[spec.url].healthy, 5)
        assert await _backend_of(client) == spec.url
    assert spec.url in router.state.limits.slots, "a joined backend gets its connection limit"


@need_epp
async def test_the_picker_routes_to_inference_pool_pods_through_envoy(fake_api, token_file, sim_factory,
                                                                      epp_factory):
    spec, base = await sim_factory("eagle3-tp8"), await sim_factory("baseline-tp8")
    api = await fake_api()
    entries = _one_pod_pools(api, spec.url, base.url)
    stack = await epp_factory(**k8s_settings(api, token_file, entries=entries, k8s_interval=0.05))
    pools = stack.epp.pools
    assert {b.url: b.pool for b in pools.backends} == {spec.url: "speculative", base.url: "baseline"}
    async with openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0, timeout=30) as client:
        assert await _backend_of(client) == spec.url
        api.pods[NS] = [p for p in api.pods[NS] if p["metadata"]["name"] != "spec-pool-0"]
        assert await poll(lambda: spec.url not in pools.by_url, 5)
        assert await _backend_of(client) == base.url
    await poll(lambda: not any(stack.inflight().values()), 5, stack.inflight)


def _down_at_start(caplog, api: FakeApi) -> None:
    """What the start logged while the API refused connections: one warning per InferencePool naming the API and
    the failure, and no traceback."""
    warned = [r.getMessage() for r in caplog.records if r.name == "router.k8s" and r.levelno == logging.WARNING]
    assert len(warned) == 2, warned  # one per InferencePool, not one per retry
    for name, line in zip(("spec-pool", "base-pool"), sorted(warned, reverse=True), strict=True):
        assert line.startswith(f"cannot read InferencePool {NS}/{name} from the Kubernetes API at {api.url}: ")
        assert "Connection refused" in line and "no backends from it until a read succeeds" in line, line
        assert "\n" not in line
    assert not [r for r in caplog.records if r.exc_info], "a refused API is no traceback"


async def test_the_proxy_waits_for_an_api_down_at_start(fake_api, token_file, sim_factory, router_factory, caplog):
    spec, base = await sim_factory("eagle3-tp8"), await sim_factory("baseline-tp8")
    api = await fake_api()
    entries = _one_pod_pools(api, spec.url, base.url)
    await api.stop()  # its port now refuses connections
    caplog.set_level(logging.INFO, logger="router.k8s")
    router = await router_factory(**k8s_settings(api, token_file, entries=entries, k8s_interval=0.05))
    pools = router.state.pools
    async with aiohttp.ClientSession() as http:
        async with http.get(router.url + "/ready") as r:
            body = await r.json()
        assert r.status == 503 and pools.backends == [] and body["backends"] == {}
        assert "no backend configured or discovered yet" in body["error"]["message"]
        await asyncio.sleep(0.2)  # a few refused rounds: still one line per InferencePool
        _down_at_start(caplog, api)
        assert router.registry.get_sample_value("router_k8s_discovery_errors_total",
                                                {"inference_pool": f"{NS}/spec-pool", "reason": "unreachable"}) > 2
        await api.start()  # the API comes up on the same port
        assert await poll(lambda: len(pools.backends) == 2 and all(b.healthy for b in pools.backends), 10,
                          lambda: pools.backends)
        async with http.get(router.url + "/ready") as r:
            assert r.status == 200 and (await r.json())["backends"] == {spec.url: True, base.url: True}
    async with openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=30) as client:
        assert await _backend_of(client) == spec.url
    assert not [r for r in caplog.records if r.exc_info]


@need_epp
async def test_the_picker_is_not_ready_until_an_api_down_at_start_answers(fake_api, token_file, sim_factory,
                                                                          epp_factory, caplog):
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    spec, base = await sim_factory("eagle3-tp8"), await sim_factory("baseline-tp8")
    api = await fake_api()
    entries = _one_pod_pools(api, spec.url, base.url)
    await api.stop()
    caplog.set_level(logging.INFO, logger="router.k8s")
    stack = await epp_factory(envoy=False, **k8s_settings(api, token_file, entries=entries, k8s_interval=0.05))
    pools = stack.epp.pools
    async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.epp_port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)

        async def readiness() -> int:
            return (await stub.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=5)).status

        await asyncio.sleep(0.2)  # the first health round is over (epp_factory waited) and more refused reads
        assert pools.backends == [] and await readiness() == health_pb2.HealthCheckResponse.NOT_SERVING
        _down_at_start(caplog, api)
        await api.start()
        assert await poll(lambda: len(pools.backends) == 2, 10, lambda: pools.backends)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while await readiness() != health_pb2.HealthCheckResponse.SERVING:
            assert loop.time() < deadline, "the picker never turned ready"
            await asyncio.sleep(0.05)
    assert all(b.healthy for b in pools.backends), "a joined backend was probed before readiness"
    assert not [r for r in caplog.records if r.exc_info]
