"""deploy/k8s: renders, validates against a pinned Kubernetes API, and holds together structurally."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from bench.sim.cli import build_parser as sim_parser
from bench.sim.profiles import load_profile
from router.discovery import is_name
from router.settings import load_settings
from tests.k8s_render import render

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("production", "sim", "gateway")
TARGETS = ("base", *(f"overlays/{o}" for o in OVERLAYS))
# The oldest Kubernetes the manifests must work on (preStop sleep, autoscaling/v2, policy/v1).
KUBERNETES_VERSION = "1.32.0"
POOLS = ("speculative", "baseline")
# Custom resources kubernetes-validate has no schema for: the Prometheus Operator's (checked structurally), the
# InferencePool (validated against deploy/k8s/crds/) and Gateway API's Gateway and HTTPRoute (checked below).
CUSTOM = {"monitoring.coreos.com": {"production": 2, "gateway": 0},
          "inference.networking.k8s.io": {"gateway": 1},
          "gateway.networking.k8s.io": {"gateway": 2}}
INFERENCE_POOL_CRD = K8S / "crds" / "inferencepools.yaml"
UPSTREAM_CRD = ROOT.parent / "shared" / "reference" / "gateway-api-inference-extension" / "inferencepools-crd.yaml"


def _objs(target: str) -> list[dict]:
    return render(K8S / target)


def _one(objs: list[dict], kind: str, name: str) -> dict:
    hits = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(hits) == 1, f"expected one {kind}/{name}, found {len(hits)}"
    return hits[0]


def _pod_spec(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"]


def _selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _router_settings(objs: list[dict]):
    cm = _one(objs, "ConfigMap", "spec-router-config")
    data = yaml.safe_load(cm["data"]["router.yaml"])
    return data, load_settings(None, data, environ={})


def _key(o: dict) -> tuple:
    return o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"]


@pytest.mark.parametrize("target", TARGETS)
def test_renderer_matches_kubectl_kustomize(target):
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed: the Python renderer alone is used")
    out = subprocess.run([kubectl, "kustomize", str(K8S / target)], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    theirs = sorted((d for d in yaml.safe_load_all(out) if d), key=_key)
    ours = sorted(_objs(target), key=_key)
    assert [_key(o) for o in ours] == [_key(o) for o in theirs]
    for a, b in zip(ours, theirs, strict=True):
        assert a == b, f"{_key(a)} differs from kubectl kustomize"


@pytest.mark.parametrize("target", TARGETS)
def test_every_object_validates_against_the_pinned_kubernetes(target):
    custom = dict.fromkeys(CUSTOM, 0)
    for obj in _objs(target):
        group = obj["apiVersion"].partition("/")[0]
        if group in CUSTOM:
            custom[group] += 1  # no schema in kubernetes-validate; checked below
            continue
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{_key(obj)}: {exc.message} at {'/'.join(map(str, exc.path))}")
    overlay = target.rpartition("/")[2]
    assert custom == {g: counts.get(overlay, 0) for g, counts in CUSTOM.items()}


def test_the_validator_rejects_a_broken_manifest():
    dep = _one(_objs("base"), "Deployment", "spec-router")
    dep["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["port"] = {"x": 1}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("target", TARGETS)
def test_no_latest_or_untagged_images(target):
    for obj in _objs(target):
        if "template" not in obj.get("spec", {}):
            continue
        for c in _pod_spec(obj)["containers"]:
            name, _, tag = c["image"].rpartition(":")
            assert name and tag and tag != "latest" and "/" not in tag, f"{_key(obj)}: image {c['image']}"


@pytest.mark.parametrize("target", ("base", "overlays/production"))
def test_sglang_pools_are_tp4_servers_with_four_gpus(target):
    objs = _objs(target)
    for pool in POOLS:
        dep = _one(objs, "Deployment", f"sglang-{pool}")
        (c,) = _pod_spec(dep)["containers"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 4
        assert c["resources"]["requests"]["nvidia.com/gpu"] == 4
        assert "--tp=4" in c["args"] and "--port=30000" in c["args"] and "--enable-metrics" in c["args"]
        assert ("--speculative-algorithm=EAGLE3" in c["args"]) == (pool == "speculative")
        assert c["image"].startswith("lmsysorg/sglang:v0.5.23")
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["httpGet"]["path"] == "/health"
        # a leaving pod keeps serving until every router has re-resolved the headless Service
        stay = c["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert stay >= _router_settings(objs)[1].discovery_interval
        assert _pod_spec(dep)["terminationGracePeriodSeconds"] >= stay + 60
        # a rollout must never ask for more GPUs than the pool holds
        assert dep["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0
    args = _pod_spec(_one(objs, "Deployment", "sglang-speculative"))["containers"][0]["args"]
    (max_running,) = [a for a in args if a.startswith("--max-running-requests=")]
    assert _router_settings(objs)[1].threshold <= int(max_running.split("=")[1])
    if target.endswith("production"):
        assert [_one(objs, "Deployment", f"sglang-{p}")["spec"]["replicas"] for p in POOLS] == [2, 2]


def test_sim_overlay_runs_simulators_without_gpus():
    objs = _objs("overlays/sim")
    for pool, profile in (("speculative", "eagle3-tp4"), ("baseline", "baseline-tp4")):
        (c,) = _pod_spec(_one(objs, "Deployment", f"sglang-{pool}"))["containers"]
        assert "nvidia.com/gpu" not in json.dumps(c["resources"])
        assert c["command"] == ["python", "-m", "bench", "sim"]
        args = sim_parser().parse_args(c["args"])  # the simulator accepts exactly these flags
        assert args.profile == profile and args.port == 30000 and args.host == "0.0.0.0"
        load_profile(args.profile)
        assert c["image"] == _pod_spec(_one(objs, "Deployment", "spec-router"))["containers"][0]["image"]
    _, settings = _router_settings(objs)
    spec = _pod_spec(_one(objs, "Deployment", "sglang-speculative"))["containers"][0]["args"]
    assert settings.threshold <= int(spec[spec.index("--max-running-requests") + 1])


@pytest.mark.parametrize("target", TARGETS)
def test_router_backend_list_matches_the_pool_services(target):
    objs = _objs(target)
    data, settings = _router_settings(objs)
    assert settings.load_signal == "backend" and settings.discovery == "dns"
    for pool in POOLS:
        urls = getattr(settings, pool)
        assert len(urls) == 1 and is_name(urls[0]), f"{pool}: one headless Service name, discovered"
        parts = urlsplit(urls[0])
        svc = _one(objs, "Service", parts.hostname)
        assert svc["spec"]["clusterIP"] == "None", "headless: DNS gives one address per pod"
        assert parts.port in [p["port"] for p in svc["spec"]["ports"]]
        dep = _one(objs, "Deployment", f"sglang-{pool}")
        assert _selects(svc["spec"]["selector"], dep["spec"]["template"]["metadata"]["labels"])
        others = [d for d in objs if d["kind"] == "Deployment" and d is not dep]
        assert not any(_selects(svc["spec"]["selector"], d["spec"]["template"]["metadata"]["labels"]) for d in others)
        container_port = _pod_spec(dep)["containers"][0]["ports"][0]
        assert container_port["containerPort"] == parts.port and container_port["name"] == "http"


@pytest.mark.parametrize("target", TARGETS)
def test_router_deployment_probes_replicas_budget_and_autoscaler(target):
    objs = _objs(target)
    dep = _one(objs, "Deployment", "spec-router")
    pod = _pod_spec(dep)
    labels = dep["spec"]["template"]["metadata"]["labels"]
    (c,) = pod["containers"]
    assert dep["spec"]["replicas"] >= 3
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
    assert pod["enableServiceLinks"] is False, "a Service named router would set ROUTER_PORT=tcp://..."
    env = {e["name"]: e for e in c["env"]}
    assert env["ROUTER_API_KEY"]["valueFrom"]["secretKeyRef"]["key"] == "api-key"
    assert "value" not in env["ROUTER_API_KEY"], "the key comes from a Secret, never from the manifest"
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert env["ROUTER_CONFIG"]["value"] == mounts["config"] + "/router.yaml"
    volume = next(v for v in pod["volumes"] if v["name"] == "config")
    assert volume["configMap"]["name"] == "spec-router-config"
    _, settings = _router_settings(objs)
    assert settings.port == c["ports"][0]["containerPort"] and settings.host == "0.0.0.0"
    assert pod["terminationGracePeriodSeconds"] > settings.drain_timeout + c["lifecycle"]["preStop"]["sleep"]["seconds"]

    svc = _one(objs, "Service", "spec-router")
    assert _selects(svc["spec"]["selector"], labels) and svc["spec"]["ports"][0]["targetPort"] == "http"
    pdb = _one(objs, "PodDisruptionBudget", "spec-router")
    assert _selects(pdb["spec"]["selector"]["matchLabels"], labels)
    assert pdb["spec"]["minAvailable"] < dep["spec"]["replicas"], "a node drain must be able to proceed"
    hpa = _one(objs, "HorizontalPodAutoscaler", "spec-router")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "spec-router"}
    assert hpa["spec"]["minReplicas"] <= dep["spec"]["replicas"] <= hpa["spec"]["maxReplicas"]
    assert hpa["spec"]["minReplicas"] > pdb["spec"]["minAvailable"]


@pytest.mark.parametrize("target", TARGETS)
def test_prometheus_annotations_on_every_pod(target):
    for obj in _objs(target):
        if obj["kind"] != "Deployment":
            continue
        ann = obj["spec"]["template"]["metadata"]["annotations"]
        port = _pod_spec(obj)["containers"][0]["ports"][0]["containerPort"]
        assert ann == {"prometheus.io/scrape": "true", "prometheus.io/port": str(port),
                       "prometheus.io/path": "/metrics"}


def test_operator_monitors_select_the_router_service_and_sglang_pods():
    objs = _objs("overlays/production")
    sm = _one(objs, "ServiceMonitor", "spec-router")
    svc = _one(objs, "Service", "spec-router")
    assert _selects(sm["spec"]["selector"]["matchLabels"], svc["metadata"]["labels"])
    assert sm["spec"]["endpoints"][0]["port"] in [p["name"] for p in svc["spec"]["ports"]]
    pm = _one(objs, "PodMonitor", "sglang")
    for pool in POOLS:
        dep = _one(objs, "Deployment", f"sglang-{pool}")
        assert _selects(pm["spec"]["selector"]["matchLabels"], dep["spec"]["template"]["metadata"]["labels"])
        assert pm["spec"]["podMetricsEndpoints"][0]["port"] == _pod_spec(dep)["containers"][0]["ports"][0]["name"]
    router_pods = _one(objs, "Deployment", "spec-router")["spec"]["template"]["metadata"]["labels"]
    assert not _selects(pm["spec"]["selector"]["matchLabels"], router_pods)
    assert {o["metadata"]["namespace"] for o in objs} == {"spec-router"}


def _inference_pool_schema() -> dict:
    crd = yaml.safe_load(INFERENCE_POOL_CRD.read_text(encoding="utf-8"))
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    assert crd["spec"]["group"] == "inference.networking.k8s.io" and crd["spec"]["names"]["kind"] == "InferencePool"
    return version["schema"]["openAPIV3Schema"]


def test_inference_pool_validates_against_the_crd_schema():
    import jsonschema

    pool = _one(_objs("overlays/gateway"), "InferencePool", "spec-router")
    schema = _inference_pool_schema()
    jsonschema.validate(pool, schema)
    # the CRD's CEL rule: a Service reference names its port
    ref = pool["spec"]["endpointPickerRef"]
    assert ref.get("kind", "Service") != "Service" or "port" in ref
    broken = json.loads(json.dumps(pool))
    broken["spec"]["endpointPickerRef"]["failureMode"] = "FailSometimes"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)
    del broken["spec"]["targetPorts"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)


def test_inference_pool_crd_is_the_upstream_copy():
    if not UPSTREAM_CRD.exists():
        pytest.skip(f"{UPSTREAM_CRD} not here: nothing to compare with")
    ours = list(yaml.safe_load_all(INFERENCE_POOL_CRD.read_text(encoding="utf-8")))
    assert ours == list(yaml.safe_load_all(UPSTREAM_CRD.read_text(encoding="utf-8")))


def test_gateway_overlay_wires_route_pool_picker_and_sglang_pods(monkeypatch, tmp_path):
    from router.__main__ import parse_command

    objs = _objs("overlays/gateway")
    pool = _one(objs, "InferencePool", "spec-router")
    sglang = [_one(objs, "Deployment", f"sglang-{p}") for p in POOLS]
    deployments = [o for o in objs if o["kind"] == "Deployment"]
    # the pool selects exactly the SGLang pods of both pools, on the port they serve
    selected = [d for d in deployments
                if _selects(pool["spec"]["selector"]["matchLabels"], d["spec"]["template"]["metadata"]["labels"])]
    assert selected == sglang
    for dep in sglang:
        assert [{"number": _pod_spec(dep)["containers"][0]["ports"][0]["containerPort"]}] == pool["spec"]["targetPorts"]
    # the picker's Service, its pods, and the settings they run with
    ref = pool["spec"]["endpointPickerRef"]
    assert ref["failureMode"] == "FailClose"
    svc = _one(objs, "Service", ref["name"])
    grpc_port = next(p for p in svc["spec"]["ports"] if p["port"] == ref["port"]["number"])
    assert grpc_port["appProtocol"] == "kubernetes.io/h2c"
    epp = _one(objs, "Deployment", ref["name"])
    assert [d for d in deployments if _selects(svc["spec"]["selector"], d["spec"]["template"]["metadata"]["labels"])
            ] == [epp]
    (c,) = _pod_spec(epp)["containers"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert grpc_port["targetPort"] == "grpc"
    data, _ = _router_settings(objs)
    config = tmp_path / "router.yaml"
    config.write_text(yaml.safe_dump(data))
    for name in [k for k in os.environ if k.startswith("ROUTER_")]:
        monkeypatch.delenv(name)
    assert c["args"][:3] == ["python", "-m", "router"]
    command, settings = parse_command([*c["args"][3:], "--config", str(config)])
    assert command == "epp" and settings.host == "0.0.0.0"
    assert settings.epp_port == ports["grpc"] == ref["port"]["number"]
    assert settings.metrics_host == "0.0.0.0" and settings.metrics_port == ports["metrics"]
    assert settings.load_signal == "backend", "several pickers (and the proxy) agree through /v1/loads"
    assert c["env"][0] == {"name": "ROUTER_CONFIG", "value": "/etc/spec-router/router.yaml"}
    assert {m["mountPath"] for m in c["volumeMounts"]} == {"/etc/spec-router"}
    # Kubernetes' gRPC probes on the picker's own health services
    for probe, service in (("readinessProbe", "readiness"), ("livenessProbe", "liveness")):
        assert c[probe]["grpc"] == {"port": settings.epp_port, "service": service}
    try:
        from router.epp.server import HEALTH_SERVICES
    except ImportError:
        HEALTH_SERVICES = ("liveness", "readiness")  # the epp extra is not installed: the names as documented
    assert {"liveness", "readiness"} <= set(HEALTH_SERVICES)
    pod = _pod_spec(epp)
    assert pod["terminationGracePeriodSeconds"] > settings.drain_timeout + c["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["enableServiceLinks"] is False
    pdb = _one(objs, "PodDisruptionBudget", ref["name"])
    assert pdb["spec"]["minAvailable"] < epp["spec"]["replicas"]
    # the route: the Gateway's listener, the OpenAI API, the InferencePool
    gw = _one(objs, "Gateway", "inference-gateway")
    route = _one(objs, "HTTPRoute", "spec-router")
    assert [r["name"] for r in route["spec"]["parentRefs"]] == [gw["metadata"]["name"]]
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                    "name": pool["metadata"]["name"]}]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/v1"}}]
    assert {o["metadata"]["namespace"] for o in objs} == {"spec-router"}


@pytest.mark.parametrize("target", TARGETS)
def test_dashboards_configmap_matches_deploy_grafana(target):
    cm = _one(_objs(target), "ConfigMap", "spec-router-dashboards")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    files = {p.name: p.read_text(encoding="utf-8") for p in (ROOT / "deploy/grafana/dashboards").glob("*.json")}
    assert files and cm["data"] == files, "copy deploy/grafana/dashboards/*.json to deploy/k8s/base/dashboards/"
    for text in cm["data"].values():
        json.loads(text)
