"""router.pools through its public methods, without sockets: outlier transitions and their logs and metrics,
retries, snapshots, membership changes. Expected values are written out by hand; each test's docstring names
the mutmut mutants it kills."""
from __future__ import annotations

import logging
import random
import time
from collections import Counter

import pytest
from prometheus_client import CollectorRegistry

from router import exporter
from router import pools as pools_mod
from router.adaptive import Adaptive
from router.metrics import Metrics
from router.observe import OK, REFUSED, Attempt, LoadFigures, Observation
from router.outlier import OutlierConfig
from router.policy import BackendLoad
from router.pools import Pools
from tests.fixtures_policy import policy_of

S1, S2, B1, B2 = "http://s1:1", "http://s2:1", "http://b1:1", "http://b2:1"


def pools(spec=(S1,), base=(B1,), registry: CollectorRegistry | None = None, keys=None, policy=None,
          **cfg) -> Pools:
    p = Pools(list(spec), list(base), policy=policy or policy_of("spillover", threshold=100), threshold=100, keys=keys, rng=random.Random(3),
              outlier_cfg=OutlierConfig(**{"consecutive_errors": 3, "base_s": 30.0, "trial_requests": 2, **cfg}))
    if registry is not None:
        exporter.bind(Metrics(registry), p)
    for b in p.backends:
        b.probe_ok(1)
    return p


def done(p: Pools, url: str) -> None:
    b = p.by_url[url]
    p.report_done(b, Observation(b.pool, b.url, 1, 1, 0.1, 0.01, 10, 3, True))


def records(caplog) -> list[tuple[str, str]]:
    return [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "router.pools"]


def test_every_outlier_transition_is_logged_and_counted(caplog):
    """The log line and ejection counter of each transition: ejected (after N failures / after a failed trial,
    the last failure named), on trial, failed trial with no other backend, passed. mutmut: every argument and
    string of Pools._log_change, its branch conditions, `tick`'s `now >= until` -> `>`, `now` ignored in tick,
    the ejection count dropped when a trial starts, the `_outcome` log condition (`!=` -> `==`)."""
    reg = CollectorRegistry()
    p = pools(registry=reg)
    spec, base = p.by_url[S1], p.by_url[B1]
    caplog.set_level(logging.INFO, logger="router.pools")
    for _ in range(3):
        p.report_attempt(spec, Attempt(OK, 500))
    first_end = spec.outlier.until
    p.tick(now=first_end - 0.5)  # not yet over: nothing
    p.tick(now=first_end)  # exactly at its end: on trial
    p.report_attempt(spec, Attempt(REFUSED))  # the trial fails while baseline can serve: ejected again, longer
    p.tick(now=spec.outlier.until)
    base.healthy = False  # the trial fails again, but now nobody else could serve
    p.report_attempt(spec, Attempt(OK, 502))
    base.healthy = True
    done(p, S1)  # active again; a success clears its one failure quietly
    for _ in range(3):
        p.report_attempt(spec, Attempt(OK, 503))
    p.tick(now=spec.outlier.until)
    done(p, S1)
    done(p, S1)  # two trial successes (trial_requests 2): fully back
    assert spec.state() == "up"
    s = f"backend {S1} (speculative)"
    assert records(caplog) == [
        ("WARNING", f"{s} ejected for 30 s (ejection 1 in a row) after 3 consecutive failures, the last: HTTP 500"),
        ("INFO", f"{s} ejection over: on trial (2 request(s) at a time until 2 succeed)"),
        ("WARNING", f"{s} ejected for 60 s (ejection 2 in a row) after a failed trial request, the last: refused"),
        ("INFO", f"{s} ejection over: on trial (2 request(s) at a time until 2 succeed)"),
        ("WARNING", f"{s} failed a trial request (HTTP 502) but no other backend is routable: back in rotation, "
                    "its errors pass through"),
        ("WARNING", f"{s} ejected for 30 s (ejection 1 in a row) after 3 consecutive failures, the last: HTTP 503"),
        ("INFO", f"{s} ejection over: on trial (2 request(s) at a time until 2 succeed)"),
        ("INFO", f"{s} passed its trial: fully back"),
    ]
    ejections = {reason: reg.get_sample_value("router_backend_ejections_total",
                                              {"pool": "speculative", "backend": S1, "reason": reason}) or 0.0
                 for reason in ("5xx", "refused", "ok")}
    assert ejections == {"5xx": 2.0, "refused": 1.0, "ok": 0.0}


def test_state_reads_the_given_time():
    """mutmut: Backend.state ignoring its `now` argument."""
    p = pools()
    spec = p.by_url[S1]
    for _ in range(3):
        p.report_attempt(spec, Attempt(REFUSED))
    end = spec.outlier.until
    assert (spec.state(end - 1), spec.state(end), spec.state()) == ("ejected", "trial", "ejected")


def test_a_success_resets_the_count_of_failures_in_a_row():
    """1 failure, a complete answer, 2 failures: 2 in a row, below 3, not ejected. mutmut: the fast path
    `s.failures == 0` -> `== 1` (it would skip clearing a single failure)."""
    p = pools()
    spec = p.by_url[S1]
    p.report_attempt(spec, Attempt(OK, 500))
    done(p, S1)
    p.report_attempt(spec, Attempt(OK, 500))
    p.report_attempt(spec, Attempt(OK, 500))
    assert spec.state() == "up"
    p.report_attempt(spec, Attempt(OK, 500))
    assert spec.state() == "ejected"


def test_an_ejected_backend_is_not_another_routable_one():
    """S1 ejected, then B1 fails for ever: B1 is the last routable backend and stays in. mutmut:
    `_others_routable(backend, now)` -> `(backend, None)`, `phase_at(o.outlier, now)` -> `(o.outlier, None)`."""
    p = pools()
    spec, base = p.by_url[S1], p.by_url[B1]
    for _ in range(3):
        p.report_attempt(spec, Attempt(REFUSED))
    for _ in range(10):
        p.report_attempt(base, Attempt(OK, 500))
    assert (spec.state(), base.state()) == ("ejected", "up")
    q = pools(spec=(S1, S2))  # with a third backend up, the second one failing is ejected too
    for url in (S1, B1):
        for _ in range(3):
            q.report_attempt(q.by_url[url], Attempt(REFUSED))
    assert [b.state() for b in q.backends] == ["ejected", "up", "ejected"]


def test_retry_targets_the_same_pool_first_breaks_ties_and_may_find_none():
    """mutmut: acquire_retry's `failed.pool` -> None, `self.rng` -> None, `target is None` always false."""
    p = pools(spec=(S1, S2), base=(B1, B2))
    lease = p.acquire_retry(p.by_url[S1])
    assert lease.backend.url == S2 and p.by_url[S2].inflight == 1
    lease.release()
    p.by_url[S2].healthy = False
    picks = Counter()
    for _ in range(100):
        lease = p.acquire_retry(p.by_url[S1])
        picks[lease.backend.url] += 1
        lease.release()
    assert set(picks) == {B1, B2} and min(picks.values()) > 20
    for url in (B1, B2):
        p.by_url[url].healthy = False
    assert p.acquire_retry(p.by_url[S1]) is None


def test_loads_are_snapshots_of_every_backend():
    """mutmut: each argument of Backend.load's BackendLoad (dropped or None)."""
    p = pools()
    p.by_url[S1].lease()
    p.by_url[S1].lease()
    p.by_url[B1].healthy = False
    assert p.loads() == [BackendLoad(S1, "speculative", 2, True), BackendLoad(B1, "baseline", 0, False)]


def on_trial_with_one_in_flight(p: Pools, b) -> bool:
    """Eject `b`, end the ejection, hold one request on it: is it still routable? (trial_requests decides)"""
    for _ in range(p.outlier_cfg.consecutive_errors):
        p.report_attempt(b, Attempt(REFUSED))
    p.tick(now=b.outlier.until)
    lease = b.lease()
    try:
        return b.routable
    finally:
        lease.release()


def test_every_backend_gets_its_pools_key_and_the_ejection_settings():
    """Backends given at start and added later carry their pool's key and the configured trial cap (1 here,
    the default is 3). mutmut: `keys.get("baseline")` and add_backend's `self._keys.get(pool)` -> None, another
    key or dropped; the `outlier_cfg` argument of Backend(...) -> None or dropped, for both pools and add_backend."""
    p = pools(spec=(S1,), base=(B1, B2), keys={"speculative": "spec-key", "baseline": "base-key"},
              trial_requests=1)
    s2 = p.add_backend(S2, "speculative")
    assert [b.auth_headers for b in p.backends] == [{"Authorization": "Bearer spec-key"}] + 2 * [
        {"Authorization": "Bearer base-key"}] + [{"Authorization": "Bearer spec-key"}]
    assert p.add_backend("http://b3:1", "baseline").auth_headers == {"Authorization": "Bearer base-key"}
    s2.probe_ok(1)
    assert [on_trial_with_one_in_flight(p, b) for b in (s2, p.by_url[B2], p.by_url[S1])] == [False, False, False]
    q = pools(keys=None)
    assert [b.auth_headers for b in q.backends] == [None, None]
    r = pools()  # the test's own check: with the cap at 2 one request in flight still admits another
    assert on_trial_with_one_in_flight(r, r.by_url[S1]) is True


def labelled(reg: CollectorRegistry, url: str) -> list[tuple[str, list]]:
    """The gauge samples of one backend: (name, sorted label items)."""
    return sorted((s.name, sorted(s.labels.items())) for m in reg.collect() for s in m.samples
                  if s.labels.get("backend") == url and not s.name.endswith(("_total", "_created")))


def test_gauges_of_a_gone_backend_are_removed():
    """An idle backend removed, and one moved to the other pool while a lease is out: the gauges of the old
    entry go (counters stay), and the old lease's release does not touch the new entry. mutmut: `_forget`'s
    `backend_state.remove(...)` arguments, add_backend's `on_drained = None` -> "" and `_forget(b)` -> None."""
    reg = CollectorRegistry()
    p = pools(spec=(S1, S2), registry=reg)
    assert [name for name, _ in labelled(reg, S2)].count("router_backend_state") == 4
    p.remove_backend(S2)
    assert labelled(reg, S2) == []
    old = p.by_url[S1].lease()
    p.remove_backend(S1)
    moved = p.add_backend(S1, "baseline")
    assert labelled(reg, S1) == sorted(
        [("router_backend_up", [("backend", S1), ("pool", "baseline")]),
         ("router_inflight_requests", [("backend", S1), ("pool", "baseline")])]
        + [("router_backend_state", [("backend", S1), ("pool", "baseline"), ("state", st)])
           for st in ("up", "down", "ejected", "trial")])
    old.release()
    assert moved.inflight == 0 and p.by_url[S1] is moved and p.draining == {}


def test_adaptive_gauges_follow_the_members():
    """A pool that gains its first member gets the adaptive gauges (they read the policy's state() through the
    live view)."""
    reg = CollectorRegistry()
    p = pools(base=(), registry=reg, policy=Adaptive(explore=0.0))
    assert reg.get_sample_value("router_adaptive_samples", {"pool": "baseline"}) is None
    p.add_backend(B1, "baseline")
    assert reg.get_sample_value("router_adaptive_samples", {"pool": "baseline"}) == 0


def test_reported_load_counts_with_what_was_sent_since():
    """mutmut: Backend.report storing None (the backend's figure ignored) or `_inflight_at_report` None."""
    p = pools()
    spec = p.by_url[S1]
    first = spec.lease()
    spec.report(7)
    second = spec.lease()
    assert spec.load_estimate == 8  # 7 reported (ours included) + 1 sent since
    first.release()
    second.release()
    assert spec.load_estimate == 6  # 7 + 0 in flight now - 1 in flight at the report


def test_releasing_to_zero_is_quiet_and_a_stray_release_is_loud(caplog):
    """mutmut: `_inflight < 0` -> `<= 0`/`< 1` (an error at every last release), the error's text and argument."""
    p = pools()
    spec = p.by_url[S1]
    lease = spec.lease()
    assert lease.released is False
    lease.release()
    assert lease.released is True
    assert records(caplog) == []
    spec._release()  # what a second release of one lease would do
    assert spec.inflight == 0
    assert records(caplog) == [("ERROR", f"in-flight count of backend {S1} went below 0: a lease was released twice")]


def test_pools_defaults_and_settings_reach_the_policy():
    """Threshold 0 never speculates; the hysteresis given reaches the global policy (built by
    router.policies.make_policy, the one builder). mutmut: `hysteresis=hysteresis` -> None or dropped."""
    p = Pools([S1], [B1], policy=policy_of("spillover", threshold=0))
    for b in p.backends:
        b.probe_ok(1)
    assert p.acquire()[1].url == B1
    g = Pools([S1], [B1], policy=policy_of("global", threshold=2), threshold=2)
    for b in g.backends:
        b.probe_ok(1)
    held = [g.acquire()[0] for _ in range(2)]  # s, s -> 2 in flight: above
    assert g.acquire()[1].url == B1
    for lease in held:
        lease.release()
    assert g.acquire()[1].url == S1  # 1 in flight (the baseline one) is below 2 - 0: back at once
    h = Pools([S1], [B1], policy=policy_of("global", threshold=2, hysteresis=1), threshold=2)
    for b in h.backends:
        b.probe_ok(1)
    held = [h.acquire()[0] for _ in range(3)]  # s, s, then b
    for lease in held[:2]:
        lease.release()
    assert h.acquire()[1].url == B1  # 1 in flight is not below 2 - 1: stays on baseline


def test_pinned_pool_any_healthy_and_the_pre_created_series():
    """mutmut: acquire's `pinned` -> None, any_healthy's generator, the series created up front (disconnects,
    durations, ejections per reason), the one-hot backend_state gauges and backend_up (`==` -> `!=`, always or
    never 1)."""
    reg = CollectorRegistry()
    p = pools(registry=reg)
    assert p.acquire("baseline")[1].reason == "pinned"
    assert p.any_healthy() is True
    for pool in ("speculative", "baseline"):
        assert reg.get_sample_value("router_client_disconnects_total", {"pool": pool}) == 0
    state = {st: reg.get_sample_value("router_backend_state", {"pool": "speculative", "backend": S1, "state": st})
             for st in ("up", "down", "ejected", "trial")}
    assert state == {"up": 1, "down": 0, "ejected": 0, "trial": 0}
    up = {"pool": "speculative", "backend": S1}
    assert reg.get_sample_value("router_backend_up", up) == 1
    assert reg.get_sample_value("router_request_duration_seconds_count", {"pool": "speculative"}) == 0
    for reason in ("5xx", "refused", "connect_timeout", "first_byte_timeout", "idle_timeout", "disconnected"):
        assert reg.get_sample_value("router_backend_ejections_total", {**up, "reason": reason}) == 0
    for _ in range(3):
        p.report_attempt(p.by_url[S1], Attempt(REFUSED))
    assert reg.get_sample_value("router_backend_state", {"pool": "speculative", "backend": S1,
                                                         "state": "ejected"}) == 1
    assert reg.get_sample_value("router_backend_up", up) == 0
    for b in p.backends:
        b.healthy = False
    assert p.any_healthy() is False


def test_an_ejection_that_ran_out_without_upkeep(caplog):
    """No tick between the end of an ejection and the next answer: a success starts the trial, a failure
    ejects again; both are logged. mutmut: the `_outcome` log condition `or` -> `and`, `phase_at(s, None)`,
    and every argument of the trial line in _log_change."""
    p = pools(base_s=0.001)
    spec = p.by_url[S1]
    caplog.set_level(logging.INFO, logger="router.pools")
    for _ in range(3):
        p.report_attempt(spec, Attempt(OK, 500))
    end = spec.outlier.until
    while time.monotonic() < end + 0.002:  # noqa: ASYNC110 - a 1 ms ejection, no event loop here
        time.sleep(0.001)
    done(p, S1)
    assert spec.state() == "trial"
    p.report_attempt(spec, Attempt(OK, 500))  # the trial fails: ejected again (2 ms)
    end = spec.outlier.until
    while time.monotonic() < end + 0.002:
        time.sleep(0.001)
    p.report_attempt(spec, Attempt(REFUSED))  # ran out, no tick: this failure ends the trial it never began
    s = f"backend {S1} (speculative)"
    got = records(caplog)
    assert got[1] == ("INFO", f"{s} ejection over: on trial (2 request(s) at a time until 2 succeed)")
    assert got[2][1].startswith(f"{s} ejected for 0.002 s (ejection 2 in a row) after a failed trial request")
    assert got[3][1].startswith(f"{s} ejected for 0.004 s (ejection 3 in a row) after a failed trial request")
    assert len(got) == 4


def test_taking_back_early_only_concerns_healthy_ejected_backends(caplog):
    """All down: nothing to take back, nothing logged, an ejected backend whose probes fail included; then the
    only healthy backend is ejected: taken back (logged), and it can be ejected again later. mutmut: tick's
    `b.healthy and phase != ACTIVE` -> `or`,
    `restore(b.outlier, now)` -> None, the log line's arguments and text."""
    p = pools()
    spec, base = p.by_url[S1], p.by_url[B1]
    caplog.set_level(logging.INFO, logger="router.pools")
    spec.healthy = base.healthy = False
    p.tick()
    assert records(caplog) == []
    spec.healthy = base.healthy = True
    for _ in range(3):  # ejected, then its probes fail too: a down backend is not taken back
        p.report_attempt(spec, Attempt(REFUSED))
    caplog.clear()
    spec.healthy = base.healthy = False
    p.tick()
    assert records(caplog) == []
    spec.healthy = base.healthy = True
    assert spec.state() == "ejected"
    spec.outlier = type(spec.outlier)()  # start the second half from a fresh outlier state
    for _ in range(3):
        p.report_attempt(spec, Attempt(REFUSED))
    base.healthy = False
    p.tick()
    assert spec.state() == "up"
    base.healthy = True
    for _ in range(3):
        p.report_attempt(spec, Attempt(REFUSED))
    assert spec.state() == "ejected"
    s = f"backend {S1} (speculative)"
    assert [m for _, m in records(caplog)][1] == (
        f"{s} taken back early: no other backend is routable, its errors pass through")


def test_load_reports_reach_the_adaptive_policy_per_backend():
    """mutmut: report_loads' `backend.url` -> None (the accept length filed under no backend)."""
    p = pools(policy=Adaptive(explore=0.0))
    p.report_loads(p.by_url[S1], LoadFigures(1, 0, 100.0, 2.5, 16))
    assert p.policy.accept_length(p.view.speculative) == 2.5


def test_a_lease_knows_the_mean_load_its_request_ran_under(monkeypatch):
    """The time-weighted in-flight count over a lease, on a clock the test sets: 1 s alone, 8 s with 9 more,
    1 s alone again -> (1 + 80 + 1) / 10 = 8.2, where the start and end counts (1 and 1) say 1. Fails if the
    integral misses a change (a lease or release that does not tick) or counts the wrong interval."""
    now = [100.0]
    monkeypatch.setattr(pools_mod, "clock", lambda: now[0])
    b = Pools(["http://s:1"], [], policy=policy_of("spillover")).backends[0]
    first = b.lease()
    now[0] += 1.0
    others = [b.lease() for _ in range(9)]
    now[0] += 8.0
    for lease in others:
        lease.release()
    now[0] += 1.0
    assert first.mean_inflight() == pytest.approx(8.2)
    assert b.inflight == 1
    later = b.lease()  # taken now: its own mean so far is the count it joined
    assert later.mean_inflight() == 2
    first.release()
    later.release()
    assert b.inflight == 0


def test_a_lease_s_mean_load_ignores_what_the_backend_carried_before_it(monkeypatch):
    """The integral is read as a difference from the lease's start: 3 request-seconds served earlier do not
    count. mutmut: Lease.mean_inflight 5 (`area(now) + area0`)."""
    now = [50.0]
    monkeypatch.setattr(pools_mod, "clock", lambda: now[0])
    b = Pools(["http://s:1"], [], policy=policy_of("spillover")).backends[0]
    before = b.lease()
    now[0] += 3.0
    before.release()  # 3 request-seconds, before the lease below
    lease = b.lease()
    now[0] += 2.0
    assert lease.mean_inflight() == pytest.approx(1.0)
    lease.release()


# ---------------------------------------------------------------- the lease's one end

def test_a_lease_finishes_once_reporting_while_it_still_counts():
    """finish(obs): the pools hear the observation while the lease still counts (the policy reads the backend's
    load with this request in it), then the lease is released; a second finish (or release) does nothing: no
    second report, no second release. Seen failing with finish's release moved before report_done (inflight 0
    in the report)."""
    p = pools()
    spec = p.by_url[S1]
    heard: list[tuple[int, Observation, object]] = []
    p.report_done = lambda b, obs, placement=None: heard.append((b.inflight, obs, placement))
    lease = spec.lease()
    obs = Observation(spec.pool, spec.url, 1, 1, 0.1, 0.01, 10, 3, True)
    assert lease.finish(obs, p, "placed") is True
    assert heard == [(1, obs, "placed")] and spec.inflight == 0 and lease.released
    assert lease.finish(obs, p) is False
    lease.release()
    assert len(heard) == 1 and spec.inflight == 0


def test_a_lease_is_released_even_when_its_report_fails():
    """A policy that raises in observe() must not leave the request counted on its backend for ever."""
    p = pools()
    spec = p.by_url[S1]

    def broken(b, obs, placement=None):
        raise RuntimeError("policy bug")

    p.report_done = broken
    lease = spec.lease()
    with pytest.raises(RuntimeError):
        lease.finish(Observation(spec.pool, spec.url, 1, 1, 0.1, 0.01, 10, 3, True), p)
    assert lease.released and spec.inflight == 0


def test_a_lease_given_up_for_a_retry_reports_nothing():
    """finish(None): an attempt abandoned for another backend; its failure went through report_attempt, nothing
    finished there, so the policy hears nothing; the lease and its started count end."""
    p = pools()
    spec = p.by_url[S1]
    p.report_done = lambda *a, **k: pytest.fail("reported")
    lease = spec.lease()
    lease.start()
    assert spec.started == 1
    assert lease.finish(None, p) is True
    assert (spec.inflight, spec.started) == (0, 0)


def test_one_figures_store_updated_once_and_read_by_the_prefix_scorer_and_the_adaptive_policy():
    from router.affinity import Affinity
    from router.core.figures import EWMA, PRIOR_OUTPUT_TOKENS, Figures

    aff = Affinity()
    pol = Adaptive(explore=0.0)
    p = Pools([S1], [B1], policy=pol, rng=random.Random(3), affinity=aff)
    assert p.figures is aff.figures is pol.figures is pol.speeds.figures and not pol.keeps_figures
    b = p.by_url[B1]
    p.report_loads(b, LoadFigures(0, 0, max_running=7))
    assert p.figures.running_limits == {B1: 7} and p.figures.limit(B1) == 7
    st = pol.state(p.view)
    assert [x["max_running_from"] for x in st["backends"]] == [None, "loads"]
    assert st["pools"]["baseline"]["max_running"] == 7
    p.report_done(b, Observation("baseline", B1, 1, 1, 1.0, 0.1, 40, 40, True))
    # One finished exchange moves the one output-token figure once; both read it.
    once = PRIOR_OUTPUT_TOKENS + EWMA * (40 - PRIOR_OUTPUT_TOKENS)
    assert p.figures.output_tokens == pytest.approx(once)
    assert pol.state(p.view)["tokens_per_request"] == round(once, 1) == aff.state()["output_tokens"]
    # Without the prefix scorer the policy still reads the store Pools keeps; a policy swapped in reads it too.
    p2 = Pools([S1], [B1], policy=Adaptive(), rng=random.Random(3))
    assert isinstance(p2.figures, Figures) and p2.policy.figures is p2.figures
    p2.policy = Adaptive()
    assert p2.policy.figures is p2.figures
