"""Static checks of the Grafana dashboards and provisioning: valid JSON for provisioning, units, variables, metrics."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARDS = sorted((GRAFANA / "dashboards").glob("*.json"))
DS_REF = {"type": "prometheus", "uid": "${datasource}"}

# Metrics issue 3 fixes for the router, and the SGLang gauges the SGLang view must show.
ROUTER_METRICS = {
    "router_inflight_requests", "router_requests_total", "router_route_decisions_total",
    "router_request_duration_seconds", "router_time_to_first_token_seconds", "router_inter_token_latency_seconds",
    "router_prompt_tokens_total", "router_completion_tokens_total", "router_backend_up", "router_threshold",
    "router_upstream_errors_total", "router_client_disconnects_total", "router_backend_state",
    "router_backend_ejections_total",
}
SGLANG_REQUIRED = {"sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:gen_throughput",
                   "sglang:token_usage", "sglang:spec_accept_length"}
GRAFANA_BUILTINS = {"__rate_interval", "__interval", "__range", "__interval_ms", "__range_s"}
METRIC_RE = re.compile(r"\b((?:router_|sglang:)[A-Za-z0-9_:]+)")
VAR_RE = re.compile(r"\$(?:\{(\w+)(?::\w+)?\}|(\w+))")


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def data_panels(dash: dict) -> list[dict]:
    out = []
    for p in dash["panels"]:
        if p["type"] == "row":
            out += p.get("panels", [])
        else:
            out.append(p)
    return out


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(dashboard file, panel title, PromQL with Grafana variables left in) for every panel target."""
    return [(path.name, p["title"], t["expr"]) for path in DASHBOARDS for p in data_panels(load(path))
            for t in p["targets"]]


def series_names(expr: str) -> set[str]:
    """Series names exactly as an expression spells them (histograms with their _bucket suffix)."""
    return set(METRIC_RE.findall(expr))


def metric_names(expr: str) -> set[str]:
    """Exported names referenced by an expression (histogram series map to their family)."""
    return {re.sub(r"_(bucket|sum|count)$", "", m) for m in METRIC_RE.findall(expr)}


def variable_queries(dash: dict) -> dict[str, str]:
    out = {}
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]
            out[v["name"]] = q["query"] if isinstance(q, dict) else q
    return out


def substitute(expr: str, values: dict[str, str]) -> str:
    """Replace Grafana variables the way Grafana would before sending the query to Prometheus."""
    def sub(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name not in values:
            raise KeyError(f"no value for ${name} in {expr!r}")
        return values[name]

    return VAR_RE.sub(sub, expr)


def test_there_are_two_dashboards() -> None:
    assert {p.name for p in DASHBOARDS} == {"router.json", "sglang.json"}
    uids = [load(p)["uid"] for p in DASHBOARDS]
    assert len(set(uids)) == len(uids) and all(re.fullmatch(r"[a-zA-Z0-9_-]{1,40}", u) for u in uids)


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_is_valid_for_provisioning(path: Path) -> None:
    dash = load(path)
    assert "id" not in dash or dash["id"] is None, "provisioned dashboards must not carry a database id"
    assert dash["title"] and isinstance(dash["schemaVersion"], int) and dash["schemaVersion"] >= 36
    ids = [p["id"] for p in dash["panels"]] + [c["id"] for p in dash["panels"] for c in p.get("panels", [])]
    assert all(isinstance(i, int) and i > 0 for i in ids)
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    cells: set[tuple[int, int]] = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        assert g["w"] > 0 and g["h"] > 0 and g["x"] >= 0 and g["y"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"panel {p['title']!r} overlaps another"
        cells |= mine


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_panel_has_datasource_unit_and_queries(path: Path) -> None:
    panels = data_panels(load(path))
    assert len(panels) >= 6
    for p in panels:
        assert p["title"] and p.get("description"), f"panel {p['id']} needs a title and a description"
        assert p["datasource"] == DS_REF, p["title"]
        unit = p["fieldConfig"]["defaults"].get("unit")
        assert isinstance(unit, str) and unit.strip(), f"panel {p['title']!r} has no unit"
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["datasource"] == DS_REF, p["title"]
            assert t["expr"].strip(), p["title"]


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_variables_are_defined_and_used(path: Path) -> None:
    dash = load(path)
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    inst = variables["instance"]
    assert inst["type"] == "query" and inst["datasource"] == DS_REF
    assert inst["includeAll"] and inst["multi"]
    if isinstance(inst["query"], dict) and inst["query"].get("qryType") == 1:
        # Grafana rebuilds a label-values query from these fields, not from the query string.
        assert inst["query"].get("label") == "instance" and inst["query"].get("metric"), inst["query"]
    assert re.fullmatch(r"label_values\([\w:]+, instance\)", variable_queries(dash)["instance"])
    for _, _, expr in [q for q in dashboard_queries() if q[0] == path.name]:
        used = {a or b for a, b in VAR_RE.findall(expr)}
        assert used <= set(variables) | GRAFANA_BUILTINS, expr
        assert "instance" in used, f"query ignores the instance variable: {expr}"


def test_dashboards_cover_the_required_metrics() -> None:
    by_file: dict[str, set[str]] = {}
    for name, _, expr in dashboard_queries():
        by_file.setdefault(name, set()).update(metric_names(expr))
    assert by_file["router.json"] >= ROUTER_METRICS, ROUTER_METRICS - by_file["router.json"]
    assert by_file["sglang.json"] >= SGLANG_REQUIRED, SGLANG_REQUIRED - by_file["sglang.json"]
    router_text = " ".join(e for n, _, e in dashboard_queries() if n == "router.json")
    for q in ("0.5", "0.95", "0.99"):
        for family in ("router_time_to_first_token_seconds", "router_inter_token_latency_seconds"):
            assert f"histogram_quantile({q}, sum by (pool, le) (rate({family}_bucket" in router_text


def exported_names() -> set[str]:
    from prometheus_client import CollectorRegistry

    from bench.sim.metrics import SimMetrics
    from router.metrics import Metrics

    names = set()
    reg = CollectorRegistry()
    Metrics(reg)
    for registry in (reg, SimMetrics("m").registry):
        for fam in registry.collect():
            names.add(fam.name + ("_total" if fam.type == "counter" else ""))
    return names


def test_no_metric_name_that_nothing_exports() -> None:
    exported = exported_names()
    for name, title, expr in dashboard_queries():
        missing = metric_names(expr) - exported
        assert not missing, f"{name} / {title}: nothing exports {sorted(missing)}"


def test_promql_parses(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (scripts/install.sh installs it with apt)")
    values = {"instance": ".*", "__rate_interval": "1m", "datasource": "prometheus"}
    rules = [{"record": f"dashboard:query_{i}", "expr": substitute(expr, values)}
             for i, (_, _, expr) in enumerate(dashboard_queries())]
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    proc = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_datasource_provisioning_points_at_the_stack_prometheus() -> None:
    cfg = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert cfg["apiVersion"] == 1
    (ds,) = cfg["datasources"]
    assert ds["type"] == "prometheus" and ds["access"] == "proxy" and ds["isDefault"]
    assert ds["url"] == "http://prometheus:9090"
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    assert "prometheus" in compose
    assert any(str(p).endswith(":9090") for p in compose["prometheus"]["ports"])
    prom = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    interval = prom["global"]["scrape_interval"]
    assert ds["jsonData"]["timeInterval"] == interval, "$__rate_interval must know the scrape interval"


def test_dashboard_provider_loads_the_mounted_directory() -> None:
    cfg = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "spec-router.yml").read_text())
    assert cfg["apiVersion"] == 1
    (prov,) = cfg["providers"]
    assert prov["type"] == "file"
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["grafana"]
    mounts = dict(str(v).split(":")[:2] for v in compose["volumes"])
    assert mounts["./deploy/grafana/dashboards"] == prov["options"]["path"]
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"


def test_every_panel_is_described_in_the_docs() -> None:
    docs = " ".join(p.read_text() for p in (ROOT / "docs" / "DEPLOY.md", ROOT / "README.md") if p.is_file())
    docs = re.sub(r"\s+", " ", docs)
    undocumented = [f"{path.name}: {p['title']}" for path in DASHBOARDS for p in data_panels(load(path))
                    if f"*{p['title']}*" not in docs]
    assert not undocumented, f"panels without a description in docs/DEPLOY.md or README.md: {undocumented}"
