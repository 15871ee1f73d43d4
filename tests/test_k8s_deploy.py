"""deploy/k8s/overlays/gateway with InferencePool discovery: the picker's settings, its RBAC (exactly the reads
router.k8s makes), and the overlay's own InferencePool and SGLang pod labels putting each pod in its pool."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest

from router.k8s import INFERENCE_POOLS, PODS
from router.settings import Settings, load_settings
from tests.k8s_render import render
from tests.test_k8s import NS, SPEC_READY, FakeApi, discovery_of, fake_api, members, serve_pod  # noqa: F401

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[1]
OVERLAY = ROOT / "deploy" / "k8s" / "overlays" / "gateway"
SA_MOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"


def _one(objs: list[dict], kind: str, name: str) -> dict:
    hits = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(hits) == 1, f"expected one {kind}/{name}, found {len(hits)}"
    return hits[0]


def _picker(objs: list[dict]) -> dict:
    pool = _one(objs, "InferencePool", "spec-router")
    return _one(objs, "Deployment", pool["spec"]["endpointPickerRef"]["name"])


def _picker_settings(objs: list[dict], tmp_path: Path) -> Settings:
    """The settings the picker's container runs with: its config file, its env (the downward API resolved as the
    kubelet would), and the variables every pod gets."""
    dep = _picker(objs)
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    namespace = dep["metadata"]["namespace"]
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    for var in c["env"]:
        if "value" in var:
            env[var["name"]] = var["value"]
        else:
            assert var["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}, var
            env[var["name"]] = namespace
    config = tmp_path / "router.yaml"
    config.write_text(_one(objs, "ConfigMap", "spec-router-config")["data"]["router.yaml"])
    assert env.pop("ROUTER_CONFIG") == "/etc/spec-router/router.yaml"
    return load_settings(str(config), {}, environ=env)


def test_the_picker_reads_the_overlays_inference_pool(tmp_path):
    objs = render(OVERLAY)
    s = _picker_settings(objs, tmp_path)
    pool = _one(objs, "InferencePool", "spec-router")
    assert s.k8s_inference_pools == [pool["metadata"]["name"]]
    assert s.k8s_namespace == pool["metadata"]["namespace"] == "spec-router"
    assert s.speculative == [] and s.baseline == [] and s.discovery == "off", "one source of backends"
    assert s.k8s_api == "https://10.96.0.1:443"
    assert (s.k8s_token_file, s.k8s_ca_file) == (f"{SA_MOUNT}/token", f"{SA_MOUNT}/ca.crt")
    assert s.load_signal == "backend", "several pickers (and the proxy) still agree through /v1/loads"


def test_the_picker_may_get_its_pool_and_list_pods_and_nothing_more():
    objs = render(OVERLAY)
    pod = _picker(objs)["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is True, "the token and CA the picker reads the API with"
    sa = _one(objs, "ServiceAccount", pod["serviceAccountName"])
    namespace = sa["metadata"]["namespace"]
    bindings = [b for b in objs if b["kind"] == "RoleBinding"
                and {"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": namespace} in b["subjects"]]
    assert len(bindings) == 1 and bindings[0]["metadata"]["namespace"] == namespace
    ref = bindings[0]["roleRef"]
    assert ref["apiGroup"] == "rbac.authorization.k8s.io" and ref["kind"] == "Role"
    role = _one(objs, "Role", ref["name"])
    assert role["metadata"]["namespace"] == namespace
    # router.k8s reads one InferencePool by name (get) and the pods of its namespace by selector (list)
    assert INFERENCE_POOLS.startswith("/apis/inference.networking.k8s.io/v1/") and PODS.startswith("/api/v1/")
    granted = sorted((g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
                     for v in rule["verbs"])
    assert granted == [("", "pods", "list"), ("inference.networking.k8s.io", "inferencepools", "get")]
    assert not [o for o in objs if o["kind"] in ("ClusterRole", "ClusterRoleBinding")]


async def test_the_overlays_pool_and_pod_labels_put_each_sglang_pod_in_its_pool(fake_api, discovery_of,  # noqa: F811
                                                                                tmp_path):
    objs = render(OVERLAY)
    api: FakeApi = await fake_api(token=None)
    pool = _one(objs, "InferencePool", "spec-router")  # the rendered manifest itself is what the API serves
    api.inference_pools = {(NS, pool["metadata"]["name"]): pool}
    # one running pod per SGLang Deployment, with the labels of its template
    pods = []
    for i, name in enumerate(("sglang-speculative", "sglang-baseline", "spec-router", "spec-router-epp")):
        pod = copy.deepcopy(api.pod(SPEC_READY))
        pod["metadata"]["name"] = f"{name}-0"
        pod["metadata"]["labels"] = _one(objs, "Deployment", name)["spec"]["template"]["metadata"]["labels"]
        serve_pod(pod, f"10.42.0.{i + 1}")
        pods.append(pod)
    api.pods = {NS: pods}
    s = _picker_settings(objs, tmp_path)
    d, _ = discovery_of({**s.model_dump(exclude_unset=True), "k8s_api": api.url,
                         "k8s_token_file": str(tmp_path / "none"), "k8s_ca_file": str(tmp_path / "none")})
    await d.refresh()
    port = pool["spec"]["targetPorts"][0]["number"]
    assert members(d) == {"speculative": [f"http://10.42.0.1:{port}"], "baseline": [f"http://10.42.0.2:{port}"]}
