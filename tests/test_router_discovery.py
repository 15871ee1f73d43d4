"""DNS discovery: one backend per address behind a name, members join and leave while leases stay exact."""
from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

import openai
import pytest
from prometheus_client import CollectorRegistry

from router import exporter
from router.discovery import endpoint_url, is_name, named_entries, static_entries, system_resolver
from router.metrics import Metrics
from router.pools import Pools
from router.settings import ConfigError, load_settings
from tests.fixtures_policy import policy_of
from tests.fixtures_router import poll

NAME = "http://sglang-speculative.pool.test:30000"


class FakeDNS:
    """The resolver seam: name -> endpoints, changed by the test while the router runs."""

    def __init__(self) -> None:
        self.records: dict[str, list[tuple[str, int]]] = {}
        self.fail = False
        self.calls = 0

    def set(self, host: str, *urls: str) -> None:
        self.records[host] = [(urlsplit(u).hostname, urlsplit(u).port) for u in urls]

    async def __call__(self, host: str, port: int) -> list[tuple[str, int]]:
        self.calls += 1
        if self.fail:
            raise OSError("temporary failure in name resolution")
        return list(self.records.get(host, []))


# ---------------------------------------------------------------- pure helpers

@pytest.mark.parametrize(("url", "named"), [
    ("http://sglang-baseline:30000", True), ("http://localhost:1", True), ("http://10.0.0.7:30000", False),
    ("http://[fd00::1]:30000", False), ("https://a.b.svc.cluster.local:443", True)])
def test_is_name(url, named):
    assert is_name(url) is named


@pytest.mark.parametrize(("url", "addr", "port", "want"), [
    ("http://svc:30000", "10.1.2.3", 30000, "http://10.1.2.3:30000"),
    ("http://svc:30000", "fd00::5", 30000, "http://[fd00::5]:30000"),
    ("http://svc:30000/prefix", "10.1.2.3", 31000, "http://10.1.2.3:31000/prefix")])
def test_endpoint_url(url, addr, port, want):
    assert endpoint_url(url, addr, port) == want


def test_entries_split_only_when_discovery_is_on():
    s = load_settings(None, {"speculative": NAME + ",http://10.0.0.9:30000", "baseline": "http://b:1"}, environ={})
    assert named_entries(s, "speculative") == [] and static_entries(s, "speculative") == s.speculative
    s = load_settings(None, {"speculative": NAME + ",http://10.0.0.9:30000", "baseline": "http://b:1",
                             "discovery": "dns"}, environ={})
    assert named_entries(s, "speculative") == [NAME]
    assert static_entries(s, "speculative") == ["http://10.0.0.9:30000"]
    assert named_entries(s, "baseline") == ["http://b:1"] and static_entries(s, "baseline") == []


@pytest.mark.parametrize("bad", [{"discovery": "consul"}, {"discovery_interval": "0"}, {"discovery_interval": "-1"}])
def test_bad_discovery_settings_are_one_line_errors(bad):
    with pytest.raises(ConfigError) as exc:
        load_settings(None, {"speculative": NAME, **bad}, environ={})
    assert "discovery" in str(exc.value) and "\n" not in str(exc.value)


async def test_system_resolver_answers_localhost():
    got = await system_resolver("localhost", 4321)
    assert ("127.0.0.1", 4321) in got and len(got) == len(set(got))


# ---------------------------------------------------------------- Pools membership

def _pools(registry: CollectorRegistry) -> Pools:
    pools = Pools(["http://10.0.0.1:1"], ["http://10.0.0.2:1"], policy=policy_of("spillover", threshold=4), threshold=4)
    exporter.bind(Metrics(registry), pools)
    return pools


def test_removed_backend_with_leases_drains_then_disappears():
    reg = CollectorRegistry()
    pools = _pools(reg)
    new = pools.add_backend("http://10.0.0.3:1", "speculative")
    assert new.healthy is False, "a newcomer carries no traffic before a health probe"
    for b in pools.backends:
        b.probe_ok(1)
    leases = [new.lease(), new.lease()]
    assert reg.get_sample_value("router_inflight_requests", {"pool": "speculative", "backend": new.url}) == 2
    assert reg.get_sample_value("router_backends", {"pool": "speculative"}) == 2

    pools.remove_backend(new.url)
    assert new.url not in pools.by_url and new not in pools.backends and pools.draining == {new.url: new}
    assert all(d.url != new.url for d in (pools.acquire()[1] for _ in range(20)))  # never chosen again
    assert reg.get_sample_value("router_backends", {"pool": "speculative"}) == 1
    leases[0].release()
    leases[0].release()  # a double release still counts once
    assert new.inflight == 1 and new.url in pools.draining
    assert reg.get_sample_value("router_inflight_requests", {"pool": "speculative", "backend": new.url}) == 1
    leases[1].release()
    assert new.inflight == 0 and pools.draining == {}
    assert reg.get_sample_value("router_inflight_requests", {"pool": "speculative", "backend": new.url}) is None
    assert reg.get_sample_value("router_backend_up", {"pool": "speculative", "backend": new.url}) is None


def test_idle_backend_is_dropped_at_once_and_readding_a_draining_one_revives_it():
    reg = CollectorRegistry()
    pools = _pools(reg)
    pools.remove_backend("http://10.0.0.2:1")
    assert [b.url for b in pools.backends] == ["http://10.0.0.1:1"] and pools.draining == {}
    b = pools.by_url["http://10.0.0.1:1"]
    lease = b.lease()
    pools.remove_backend(b.url)
    assert pools.add_backend(b.url, "speculative") is b and pools.draining == {}
    lease.release()
    assert pools.by_url[b.url] is b and b.inflight == 0, "a revived backend is not dropped by its old leases"
    assert reg.get_sample_value("router_inflight_requests", {"pool": "speculative", "backend": b.url}) == 0
    assert pools.add_backend(b.url, "speculative") is b  # adding twice is a no-op
    assert len(pools.backends) == 1


def test_the_policy_sees_members_as_they_change():
    pools = Pools(["http://10.0.0.1:1"], [], policy=policy_of("least-inflight"))
    first = pools.by_url["http://10.0.0.1:1"]
    first.probe_ok(1)
    held = [first.lease(), first.lease()]
    new = pools.add_backend("http://10.0.0.3:1", "speculative")
    new.probe_ok(1)
    lease, decision = pools.acquire()
    assert decision.url == new.url, "a joined backend is a candidate"
    lease.release()
    pools.remove_backend(new.url)
    assert all(pools.acquire()[1].url == first.url for _ in range(5))
    for h in held:
        h.release()


# ---------------------------------------------------------------- a running router, several simulators, one name

async def _backend_of(client: openai.AsyncOpenAI) -> str:
    raw = await client.chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert raw.parse().choices[0].message.content
    return raw.headers["X-Router-Backend"]


async def test_members_join_and_leave_without_restart(sim_factory, router_factory):
    sims = [await sim_factory() for _ in range(3)]
    dns = FakeDNS()
    dns.set("sglang-speculative.pool.test", sims[0].url, sims[1].url)
    router = await router_factory(speculative=[NAME], discovery="dns", discovery_interval=0.1, resolver=dns,
                                  policy="least-inflight")
    pools = router.state.pools
    assert sorted(pools.by_url) == sorted([sims[0].url, sims[1].url])
    async with openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0) as client:
        seen = {await _backend_of(client) for _ in range(12)}
        assert seen == {sims[0].url, sims[1].url}

        dns.set("sglang-speculative.pool.test", *(s.url for s in sims))
        assert await poll(lambda: sims[2].url in pools.by_url and pools.by_url[sims[2].url].healthy, 5)
        seen = {await _backend_of(client) for _ in range(18)}
        assert sims[2].url in seen
        assert sims[2].url in router.state.limits.slots, "a joined backend gets its connection limit"
        assert router.metric("router_upstream_waiting_requests", pool="speculative", backend=sims[2].url) == 0
        assert router.registry.get_sample_value("router_upstream_waiting_requests",
                                                {"pool": "speculative", "backend": sims[2].url}) is not None

        dns.set("sglang-speculative.pool.test", sims[2].url)
        assert await poll(lambda: sorted(pools.by_url) == [sims[2].url], 5)
        assert {await _backend_of(client) for _ in range(6)} == {sims[2].url}
    assert router.metric("router_backends", pool="speculative") == 1


async def test_dns_failure_keeps_the_known_members(sim_factory, router_factory):
    sims = [await sim_factory() for _ in range(2)]
    dns = FakeDNS()
    dns.set("sglang-speculative.pool.test", *(s.url for s in sims))
    router = await router_factory(speculative=[NAME], discovery="dns", discovery_interval=0.05, resolver=dns)
    dns.fail = True
    calls = dns.calls
    assert await poll(lambda: dns.calls >= calls + 3, 5)
    dns.fail = False
    dns.records.clear()  # an empty answer is no better than a failure
    calls = dns.calls
    assert await poll(lambda: dns.calls >= calls + 3, 5)
    assert sorted(router.state.pools.by_url) == sorted(s.url for s in sims)
    assert router.metric("router_discovery_failures_total", pool="speculative") >= 6
    async with openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0) as client:
        assert await _backend_of(client) in {s.url for s in sims}


async def test_a_leaving_member_finishes_its_stream(sim_factory, router_factory):
    slow = await sim_factory(speedup=2.0)
    other = await sim_factory()
    dns = FakeDNS()
    dns.set("sglang-speculative.pool.test", slow.url)
    router = await router_factory(speculative=[NAME], discovery="dns", discovery_interval=0.05, resolver=dns)
    pools = router.state.pools
    async with openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=30) as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="m", messages=[{"role": "user", "content": "a long answer"}], max_tokens=60, stream=True,
            stream_options={"include_usage": True})
        assert raw.headers["X-Router-Backend"] == slow.url
        stream = raw.parse()
        it = stream.__aiter__()
        first = await it.__anext__()
        assert first.choices

        dns.set("sglang-speculative.pool.test", other.url)
        assert await poll(lambda: slow.url not in pools.by_url and slow.url in pools.draining, 5)
        leaving = pools.draining[slow.url]
        assert leaving.inflight == 1
        # New requests go to the newcomer while the old stream is still running.
        assert await poll(lambda: pools.by_url.get(other.url) is not None and pools.by_url[other.url].healthy, 5)
        assert await _backend_of(client) == other.url

        usage = None
        async for chunk in it:
            usage = chunk.usage or usage
        assert usage is not None and usage.completion_tokens == 60, "the stream ran to its end"
    assert await poll(lambda: slow.url not in pools.draining, 5)
    assert leaving.inflight == 0
    assert router.metric("router_inflight_requests", pool="speculative", backend=slow.url) == 0
    assert await router.wait_idle() == {other.url: 0}


async def test_static_entries_and_names_mix(sim_factory, router_factory):
    named, fixed, base, joined = (await sim_factory(), await sim_factory(), await sim_factory(),
                                  await sim_factory())
    dns = FakeDNS()
    dns.set("sglang-speculative.pool.test", named.url, fixed.url)  # the name also lists the fixed one
    router = await router_factory(speculative=[NAME, fixed.url], baseline=[base.url], discovery="dns",
                                  discovery_interval=0.05, resolver=dns)
    pools = router.state.pools
    assert sorted(pools.by_url) == sorted([named.url, fixed.url, base.url])
    # The name drops the fixed address and lists a new one in the same answer: the new one joining proves the
    # answer was applied, so the fixed one staying is the rule, not a round that never ran.
    dns.set("sglang-speculative.pool.test", named.url, joined.url)
    assert await poll(lambda: joined.url in pools.by_url, 5)
    assert fixed.url in pools.by_url, "a configured address stays when the name stops listing it"
    await asyncio.sleep(0)
    assert pools.by_url[base.url].pool == "baseline"


async def test_the_system_resolver_expands_a_real_name(sim_factory, router_factory):
    sim = await sim_factory()
    port = urlsplit(sim.url).port
    router = await router_factory(speculative=[f"http://localhost:{port}"], discovery="dns")
    pools = router.state.pools
    assert sim.url in pools.by_url and f"http://localhost:{port}" not in pools.by_url
    async with openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0) as client:
        assert await _backend_of(client) == sim.url
