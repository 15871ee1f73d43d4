"""A real Prometheus scrapes a live router and two simulators under load; every dashboard query must return data."""
from __future__ import annotations

import asyncio
import contextlib
import math
import re
import shutil
import socket
import subprocess
from collections import Counter
from pathlib import Path

import aiohttp
import openai
import pytest
import yaml

from tests.fixtures_router import poll
from tests.test_deploy_dashboards import (
    DASHBOARDS,
    dashboard_queries,
    load,
    series_names,
    substitute,
    variable_queries,
)

ROOT = Path(__file__).resolve().parent.parent
PROM_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
# Stands in for Grafana's $__rate_interval: wide enough to cover the whole short load run.
RATE_WINDOW = "1m"
ADAPTIVE = "router_adaptive_"  # series only the adaptive policy exports
SCRAPE_SECONDS = 1.0
PHASE_SECONDS = 8.0
MAX_LOAD_SECONDS = 45.0
MAX_REQUESTS = 20000


def test_shipped_config_passes_promtool() -> None:
    if PROMTOOL is None:
        pytest.skip("promtool is not installed (scripts/install.sh installs Debian's prometheus package)")
    proc = subprocess.run([PROMTOOL, "check", "config", str(PROM_CONFIG)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout + proc.stderr


def test_promtool_rejects_a_broken_config(tmp_path: Path) -> None:
    """The check above can fail: the same tool on a config with a typo'd key."""
    if PROMTOOL is None:
        pytest.skip("promtool is not installed (scripts/install.sh installs Debian's prometheus package)")
    bad = tmp_path / "bad.yml"
    bad.write_text(PROM_CONFIG.read_text().replace("scrape_configs:", "scrape_config:"))
    proc = subprocess.run([PROMTOOL, "check", "config", str(bad)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0


def live_config(targets: dict[str, str]) -> dict:
    """The shipped config with the compose service addresses swapped for live loopback ones."""
    cfg = yaml.safe_load(PROM_CONFIG.read_text())
    cfg["global"]["scrape_interval"] = f"{SCRAPE_SECONDS:g}s"
    cfg["global"]["evaluation_interval"] = f"{SCRAPE_SECONDS:g}s"
    for job in cfg["scrape_configs"]:
        for sc in job["static_configs"]:
            sc["targets"] = [targets[t] for t in sc["targets"]]  # KeyError: a target the test does not know
    return cfg


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.asynccontextmanager
async def run_prometheus(config: dict, workdir: Path):
    """Start Prometheus on 127.0.0.1 (free port, retried on a race), yield its URL, stop it by PID."""
    cfg_path = workdir / "prometheus.yml"
    cfg_path.write_text(yaml.safe_dump(config))
    log_path = workdir / "prometheus.log"
    proc = None
    url = ""
    async with aiohttp.ClientSession() as http:
        for _attempt in range(3):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            with log_path.open("wb") as log:
                proc = await asyncio.create_subprocess_exec(
                    PROMETHEUS, f"--config.file={cfg_path}", f"--storage.tsdb.path={workdir / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn",
                    stdin=subprocess.DEVNULL, stdout=log, stderr=log)
            ready = False
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 20
            while proc.returncode is None and loop.time() < deadline:
                with contextlib.suppress(aiohttp.ClientError, OSError):
                    async with http.get(url + "/-/ready", timeout=aiohttp.ClientTimeout(total=2)) as r:
                        if r.status == 200:
                            ready = True
                            break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(proc.wait(), 0.2)
            if ready:
                break
            await stop(proc)
            if "address already in use" not in log_path.read_text(errors="replace"):
                break
        if not ready:
            pytest.fail(f"prometheus did not become ready: {log_path.read_text(errors='replace')[-800:]}")
    try:
        yield url
    finally:
        await stop(proc)


async def stop(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except TimeoutError:
            proc.kill()
            await proc.wait()


class Prom:
    def __init__(self, http: aiohttp.ClientSession, url: str) -> None:
        self.http, self.url = http, url

    async def get(self, path: str, **params: str) -> object:
        async with self.http.get(self.url + path, params=params, timeout=aiohttp.ClientTimeout(total=10)) as r:
            body = await r.json()
        assert body["status"] == "success", body
        return body["data"]

    async def scraped(self, times: int = 2, within: float = 15.0) -> None:
        """Until every target has been scraped `times` more times (its lastScrape changed), bounded.
        Two changes mean at least one whole scrape began after this call."""
        async def last() -> dict[str, str]:
            return {t["scrapeUrl"]: t["lastScrape"] for t in (await self.get("/api/v1/targets"))["activeTargets"]}

        seen = {url: [stamp] for url, stamp in (await last()).items()}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        while any(len(s) <= times for s in seen.values()):
            assert loop.time() < deadline, f"prometheus stopped scraping: {seen}"
            await asyncio.sleep(0.1)
            for url, stamp in (await last()).items():
                if stamp != seen[url][-1]:
                    seen[url].append(stamp)

    async def query(self, expr: str) -> list[dict]:
        data = await self.get("/api/v1/query", query=expr)
        assert data["resultType"] in ("vector", "scalar"), data
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]


def finite(result: list[dict]) -> list[float]:
    values = [float(s["value"][1]) for s in result]
    return [v for v in values if math.isfinite(v)]


def regex_of(values: list[str]) -> str:
    """A multi-value variable as Grafana renders it inside a PromQL =~ string."""
    return "(" + "|".join(re.escape(v).replace("\\", "\\\\") for v in values) + ")"


async def drive_load(router_url: str, spec_url: str, base_url: str, router, prom: Prom) -> Counter:
    """Streams above the threshold plus, in turn, backend errors, retries, a failover and disconnects.

    Each fault phase lasts until the router has visibly reacted to it (bounded), not a fixed time."""
    client = openai.AsyncOpenAI(base_url=router_url + "/v1", api_key="unused", max_retries=0, timeout=30)
    counts: Counter = Counter()
    loop = asyncio.get_running_loop()
    hard_deadline = loop.time() + MAX_LOAD_SECONDS
    done = asyncio.Event()
    messages = [{"role": "user", "content": "Write a short poem about routers."}]

    def running() -> bool:
        return not done.is_set() and counts["sent"] < MAX_REQUESTS and loop.time() < hard_deadline

    async def worker() -> None:
        while running():
            counts["sent"] += 1
            try:
                stream = await client.chat.completions.create(model="default", messages=messages, max_tokens=40,
                                                              stream=True)
                async for _ in stream:
                    pass
                counts["ok"] += 1
            except openai.APIStatusError as exc:
                counts[exc.status_code] += 1

    async def disconnector() -> None:
        while running():
            counts["sent"] += 1
            try:
                stream = await client.chat.completions.create(model="default", messages=messages,
                                                              max_tokens=4000, stream=True)
            except openai.APIStatusError as exc:  # the error phase hits this client too
                counts[exc.status_code] += 1
                continue
            async for _ in stream:
                break
            await stream.close()
            counts["disconnected"] += 1
            await asyncio.sleep(0.3)

    async def faults(url: str, update: dict | None) -> None:
        async with aiohttp.ClientSession() as http:
            if update is None:
                async with http.delete(url + "/_sim/faults") as r:
                    assert r.status == 200
            else:
                async with http.post(url + "/_sim/faults", json=update) as r:
                    assert r.status == 200, await r.text()

    def metric(name: str, **labels: str) -> float:
        return router.metric(name, **labels)

    async def phase(what: str, cond) -> None:
        assert await poll(cond, PHASE_SECONDS), f"router never showed {what} ({counts})"
        await prom.scraped()  # Prometheus has seen the phase

    async def chaos() -> None:
        try:
            await phase("both pools busy", lambda: metric("router_route_decisions_total", pool="baseline",
                                                          reason="above_threshold") > 0)
            await faults(base_url, {"error_rate": 0.3, "error_status": 500})  # errors the client sees
            await phase("a 500", lambda: counts[500] > 0)
            await faults(base_url, {"error_rate": 1.0, "error_status": 503})  # retried on the other pool
            await phase("a retry", lambda: metric("router_retries_total", pool="speculative") > 0)
            await faults(base_url, None)
            await faults(spec_url, {"health_status": 503})  # speculative pool down: failover
            await phase("a failover", lambda: metric("router_route_decisions_total", pool="baseline",
                                                     reason="failover") > 0)
            await faults(spec_url, None)
            await phase("the backend back up", lambda: metric("router_backend_up", pool="speculative",
                                                              backend=spec_url) == 1)
            await phase("a client disconnect", lambda: counts["disconnected"] > 0)
        finally:
            done.set()

    try:
        async with asyncio.timeout(MAX_LOAD_SECONDS + 10):
            await asyncio.gather(chaos(), disconnector(), *(worker() for _ in range(6)))
    finally:
        await client.close()
    return counts


@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus is not installed (scripts/install.sh installs it)")
async def test_every_dashboard_query_returns_data(sim_factory, router_factory, tmp_path: Path) -> None:
    spec = await sim_factory("eagle3-tp8", speedup=20.0)
    base = await sim_factory("baseline-tp8", speedup=20.0)
    router = await router_factory(speculative=[spec.url], baseline=[base.url], threshold=2)
    addr = {u: u.removeprefix("http://") for u in (router.url, spec.url, base.url)}
    config = live_config({"router:8000": addr[router.url], "sglang-speculative:30000": addr[spec.url],
                          "sglang-baseline:30000": addr[base.url]})

    async with run_prometheus(config, tmp_path) as prom_url, aiohttp.ClientSession() as http:
        prom = Prom(http, prom_url)

        async def all_targets_up() -> bool:
            targets = (await prom.get("/api/v1/targets"))["activeTargets"]
            return len(targets) == 3 and all(t["health"] == "up" for t in targets)

        for _ in range(50):  # bounded: ~15 s
            if await all_targets_up():
                break
            await asyncio.sleep(0.3)
        else:
            pytest.fail(f"prometheus targets not up: {await prom.get('/api/v1/targets')}")

        counts = await drive_load(router.url, spec.url, base.url, router, prom)
        print(f"load through the router: {dict(counts)}")
        assert counts["ok"] > 20 and counts[500] > 0 and counts["disconnected"] > 0, counts
        assert await router.wait_idle() == dict.fromkeys(router.inflight(), 0)
        await prom.scraped(times=3)  # a few more scrapes: the idle state and the last counter values

        # Variables first: Grafana resolves them before it runs a panel's query.
        values: dict[str, dict[str, str]] = {}
        for path in DASHBOARDS:
            found = []
            for name, query in variable_queries(load(path)).items():
                m = re.fullmatch(r"label_values\(([\w:]+), (\w+)\)", query)
                assert m, query
                found = await prom.get(f"/api/v1/label/{m.group(2)}/values", **{"match[]": m.group(1)})
                assert found, f"{path.name}: variable {name} has no values"
                values[path.name] = {name: regex_of(found), "__rate_interval": RATE_WINDOW}
            if path.name == "router.json":
                assert found == [addr[router.url]]
            else:
                assert sorted(found) == sorted([addr[spec.url], addr[base.url]])

        names = set(await prom.get("/api/v1/label/__name__/values"))
        dead: list[str] = []
        for dash, title, expr in dashboard_queries():
            if ADAPTIVE in expr:
                continue  # the Learned model row: test_learned_model_panels_return_data, under the adaptive policy
            missing = series_names(expr) - names
            if missing:
                dead.append(f"{dash} / {title}: no series named {sorted(missing)}")
                continue
            result = await prom.query(substitute(expr, values[dash]))
            if not finite(result):
                dead.append(f"{dash} / {title}: no data for {expr}")
        assert not dead, "dead panels:\n" + "\n".join(dead)

        # What the dashboards show must match what happened.
        inflight = await prom.query('sum(router_inflight_requests)')
        assert finite(inflight) == [0.0], "the in-flight panel must fall back to 0 when traffic stops"
        reasons = {s["metric"]["reason"] for s in await prom.query("router_route_decisions_total")}
        assert {"below_threshold", "above_threshold", "failover", "retry"} <= reasons, (reasons, counts)
        share = await prom.query(
            f"sum by (pool) (increase(router_requests_total[{RATE_WINDOW}])) / ignoring(pool) group_left "
            f"sum(increase(router_requests_total[{RATE_WINDOW}]))")
        # "none": answers the router gave without a backend (a 503 while a loaded machine's probes failed).
        assert {"speculative", "baseline"} <= {s["metric"]["pool"] for s in share} <= {"speculative", "baseline", "none"}
        assert sum(finite(share)) == pytest.approx(1.0)
        pools = {s["metric"]["pool"] for s in await prom.query("sglang:num_running_reqs")}
        assert pools == {"speculative", "baseline"}, "the shipped config labels each SGLang target with its pool"


@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus is not installed (scripts/install.sh installs it)")
async def test_learned_model_panels_return_data(sim_factory, router_factory, tmp_path: Path) -> None:
    spec = await sim_factory("eagle3-tp8", speedup=20.0)
    base = await sim_factory("baseline-tp8", speedup=20.0)
    router = await router_factory(speculative=[spec.url], baseline=[base.url], policy="adaptive",
                                  load_signal="backend", load_interval=0.2)
    addr = {u: u.removeprefix("http://") for u in (router.url, spec.url, base.url)}
    config = live_config({"router:8000": addr[router.url], "sglang-speculative:30000": addr[spec.url],
                          "sglang-baseline:30000": addr[base.url]})
    async with run_prometheus(config, tmp_path) as prom_url, aiohttp.ClientSession() as http:
        prom = Prom(http, prom_url)
        async with openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0,
                                      timeout=30) as client:

            async def one() -> None:
                stream = await client.chat.completions.create(
                    model="default", messages=[{"role": "user", "content": "Write a python function."}],
                    max_tokens=40, stream=True)
                async for _ in stream:
                    pass

            for _ in range(6):  # bounded: 6 rounds of 4 concurrent streams, and the scrapes in between
                await asyncio.gather(*(one() for _ in range(4)))
                await asyncio.sleep(0.5)
        assert await router.wait_idle() == dict.fromkeys(router.inflight(), 0)
        values = {"instance": regex_of([addr[router.url]]), "__rate_interval": RATE_WINDOW}
        learned = [(t, e) for d, t, e in dashboard_queries() if d == "router.json" and ADAPTIVE in e]
        assert len(learned) >= 4
        dead = []
        for title, expr in learned:
            ok = await poll_async(lambda expr=expr: prom.query(substitute(expr, values)), 15.0)
            if not ok:
                dead.append(f"{title}: no data for {expr}")
        assert not dead, "dead panels:\n" + "\n".join(dead)


async def poll_async(query, within: float) -> bool:
    """Re-run a Prometheus query until it returns finite data (a scrape may not have happened yet); bounded."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        if finite(await query()):
            return True
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(0.5)
