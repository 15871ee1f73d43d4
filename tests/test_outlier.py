"""Passive ejection without sockets: the state machine by tables, Pools' use of it, local errors, states."""
from __future__ import annotations

import errno
import logging
import socket
import time

import pytest

from router.errors import UpstreamConnectError, UpstreamLocalError
from router.observe import (
    CONNECT_TIMEOUT,
    DISCONNECTED,
    FIRST_BYTE_TIMEOUT,
    IDLE_TIMEOUT,
    LOCAL,
    OK,
    REFUSED,
    Attempt,
    Observation,
)
from router.outlier import (
    ACTIVE,
    EJECTED,
    FAILURE,
    NEUTRAL,
    SUCCESS,
    TRIAL,
    OutlierConfig,
    OutlierState,
    admits,
    classify,
    ejection_s,
    phase_at,
    step,
)
from router.pools import Pools
from router.upstream import FIRST_BYTE, ConnectFailed, map_error
from tests.fixtures_policy import policy_of

S1, B1 = "http://s1:1", "http://b1:1"
CFG = OutlierConfig(consecutive_errors=3, base_s=10.0, max_s=60.0, trial_requests=2)


@pytest.mark.parametrize(("kind", "status", "outcome"), [
    (OK, 200, SUCCESS), (OK, 204, SUCCESS), (OK, 302, SUCCESS),
    (OK, 400, NEUTRAL), (OK, 401, NEUTRAL), (OK, 404, NEUTRAL), (OK, 429, NEUTRAL),  # the request's fault
    (OK, 500, FAILURE), (OK, 502, FAILURE), (OK, 503, FAILURE), (OK, 504, FAILURE),
    (REFUSED, None, FAILURE), (CONNECT_TIMEOUT, None, FAILURE), (FIRST_BYTE_TIMEOUT, None, FAILURE),
    (IDLE_TIMEOUT, None, FAILURE), (DISCONNECTED, None, FAILURE),
    (LOCAL, None, NEUTRAL),  # ours (file descriptors, DNS), never the backend's
])
def test_classify(kind, status, outcome):
    assert classify(kind, status) == outcome


def run(outcomes: str, cfg: OutlierConfig = CFG, start: OutlierState | None = None, t: float = 0.0,
        may_eject: bool = True) -> OutlierState:
    """Feed outcomes at time t: F failure, S success, N neutral."""
    s = start or OutlierState()
    for o in outcomes:
        s = step(s, {"F": FAILURE, "S": SUCCESS, "N": NEUTRAL}[o], t, cfg, may_eject)
    return s


@pytest.mark.parametrize(("outcomes", "phase", "failures"), [
    ("", ACTIVE, 0),
    ("F", ACTIVE, 1),
    ("FF", ACTIVE, 2),
    ("FFF", EJECTED, 0),  # the third in a row ejects
    ("FFSF", ACTIVE, 1),  # a success in between resets the count
    ("FFNF", EJECTED, 0),  # a 4xx neither counts nor resets
    ("NNNNNN", ACTIVE, 0),
    ("FFFFFF", EJECTED, 0),  # answers to requests sent before the ejection change nothing
    ("FFFSSS", EJECTED, 0),
])
def test_consecutive_failures(outcomes, phase, failures):
    s = run(outcomes)
    assert (s.phase, s.failures) == (phase, failures)


def test_ejection_then_trial_then_back():
    s = run("FFF", t=100.0)
    assert s.phase == EJECTED and s.until == 110.0 and s.ejections == 1
    assert phase_at(s, 109.9) == EJECTED and not admits(s, 109.9, 0, CFG)
    # The ejection runs out by itself: the backend is on trial, a few requests at a time.
    assert phase_at(s, 110.0) == TRIAL
    assert admits(s, 110.0, 0, CFG) and admits(s, 110.0, 1, CFG) and not admits(s, 110.0, 2, CFG)
    s = step(s, SUCCESS, 110.5, CFG, True)
    assert (s.phase, s.trial_ok) == (TRIAL, 1)
    s = step(s, NEUTRAL, 110.6, CFG, True)
    assert (s.phase, s.trial_ok) == (TRIAL, 1)
    s = step(s, SUCCESS, 111.0, CFG, True)
    assert s.phase == ACTIVE and s.back_at == 111.0 and s.failures == 0
    assert admits(s, 111.0, 1000, CFG)  # fully back: no cap


@pytest.mark.parametrize(("n", "length"), [(1, 10.0), (2, 20.0), (3, 40.0), (4, 60.0), (5, 60.0), (200, 60.0)])
def test_ejection_length_doubles_up_to_the_cap(n, length):
    assert ejection_s(n, CFG) == length


def test_repeated_failures_lengthen_the_ejection():
    s = run("FFF", t=0.0)
    assert s.until == 10.0
    s = step(s, FAILURE, 10.0, CFG, True)  # the first trial request fails: out again, for longer
    assert (s.phase, s.ejections, s.until) == (EJECTED, 2, 30.0)
    s = step(s, FAILURE, 30.5, CFG, True)
    assert (s.phase, s.ejections, s.until) == (EJECTED, 3, 70.5)
    # It passes its trial, but fails again soon after: the streak goes on (80 s, capped at 60).
    s = run("SS", start=s, t=71.0)
    assert s.phase == ACTIVE
    s = run("FFF", start=s, t=80.0)
    assert (s.ejections, s.until) == (4, 140.0)
    # Fully back for max_s: old trouble is forgiven, the next ejection is short again.
    s = run("SS", start=s, t=140.0)
    s = run("FFF", start=s, t=200.0)
    assert (s.ejections, s.until) == (1, 210.0)


def test_never_ejected_when_no_other_backend_could_serve():
    s = run("FFFFFFFFFF", may_eject=False)
    assert s.phase == ACTIVE and s.failures == 10
    # As soon as another backend can take the traffic, the next failure ejects.
    assert step(s, FAILURE, 0.0, CFG, True).phase == EJECTED
    # On trial and alone: back in rotation with its errors passing through, not ejected.
    t = run("FFF")
    t = step(t, FAILURE, 10.0, CFG, False)
    assert (t.phase, t.failures) == (ACTIVE, 1)


def test_zero_consecutive_errors_disables_ejection():
    cfg = OutlierConfig(consecutive_errors=0)
    assert run("F" * 50, cfg=cfg) == OutlierState()


# ---- Pools: the seam's report_attempt drives the machine; the policy sees `routable`

def pools(**cfg) -> Pools:
    return Pools([S1], [B1], policy=policy_of("spillover", threshold=100), threshold=100,
                 outlier_cfg=OutlierConfig(**{"consecutive_errors": 3, "base_s": 30.0, **cfg}))


def up(p: Pools) -> Pools:
    for b in p.backends:
        b.probe_ok(1)
    return p


def test_pools_eject_and_the_policy_stops_choosing_it(caplog):
    p = up(pools())
    spec = p.by_url[S1]
    caplog.set_level(logging.INFO, logger="router.pools")
    for _ in range(3):
        lease, d = p.acquire()
        assert d.url == S1
        p.report_attempt(spec, Attempt(OK, 500))
        lease.release()
    assert spec.state() == EJECTED and not spec.routable and spec.healthy
    lease, d = p.acquire()
    assert d.url == B1 and d.reason == "failover"
    lease.release()
    assert [b.inflight for b in p.backends] == [0, 0]
    assert "ejected for 30 s" in caplog.text and "HTTP 500" in caplog.text


def test_pools_never_eject_the_last_routable_backend(caplog):
    p = up(pools())
    p.by_url[B1].healthy = False  # the baseline pool is down
    spec = p.by_url[S1]
    for _ in range(10):
        p.report_attempt(spec, Attempt(OK, 500))
    assert spec.state() == "up" and spec.routable
    assert "ejected" not in caplog.text


def test_pools_take_an_ejected_backend_back_when_the_others_go_down(caplog):
    p = up(pools())
    spec = p.by_url[S1]
    for _ in range(3):
        p.report_attempt(spec, Attempt(REFUSED))
    assert spec.state() == EJECTED
    caplog.set_level(logging.INFO, logger="router.pools")
    p.by_url[B1].healthy = False
    p.tick()
    assert spec.state() == "up" and spec.routable
    assert "taken back early" in caplog.text


def test_pools_trial_caps_requests_in_flight(caplog):
    p = up(pools(base_s=0.001, trial_requests=2))
    spec = p.by_url[S1]
    for _ in range(3):
        p.report_attempt(spec, Attempt(CONNECT_TIMEOUT))
    caplog.set_level(logging.INFO, logger="router.pools")
    time.sleep(0.01)  # the 1 ms ejection runs out
    assert spec.state() == TRIAL
    p.tick()
    assert "on trial" in caplog.text
    first, d1 = p.acquire()
    second, d2 = p.acquire()
    third, d3 = p.acquire()
    # Two trial requests at a time; the third goes elsewhere although spillover would pick speculative.
    assert (d1.url, d2.url, d3.url) == (S1, S1, B1)
    p.report_attempt(spec, Attempt(OK, 200))
    p.report_done(spec, done(spec, ok=True))
    first.release()
    assert spec.state() == TRIAL
    p.report_attempt(spec, Attempt(OK, 200))
    p.report_done(spec, done(spec, ok=True))
    second.release()
    third.release()
    assert spec.state() == "up" and "fully back" in caplog.text
    assert [b.inflight for b in p.backends] == [0, 0]


def done(b, ok: bool) -> Observation:
    return Observation(b.pool, b.url, 1, 1, 0.1, 0.01, 10, 3, ok)


def test_good_headers_are_no_success_until_the_answer_is_complete():
    # A backend that answers 200 and then stalls every stream: each exchange reports good headers, then an
    # idle timeout. The headers must not reset the count, or such a backend would never be ejected.
    p = up(pools())
    spec = p.by_url[S1]
    for _ in range(3):
        p.report_attempt(spec, Attempt(OK, 200))
        p.report_attempt(spec, Attempt(IDLE_TIMEOUT))
        p.report_done(spec, done(spec, ok=False))
    assert spec.state() == EJECTED
    # Complete answers do reset it; unfinished ones (client disconnects) change nothing.
    q = up(pools())
    spec = q.by_url[S1]
    q.report_attempt(spec, Attempt(OK, 500))
    q.report_done(spec, done(spec, ok=False))
    q.report_attempt(spec, Attempt(OK, 500))
    assert spec.outlier.failures == 2
    q.report_done(spec, done(spec, ok=False))
    assert spec.outlier.failures == 2
    q.report_done(spec, done(spec, ok=True))
    assert (spec.state(), spec.outlier.failures) == ("up", 0)


def test_local_errors_never_count():
    p = up(pools())
    spec = p.by_url[S1]
    for _ in range(20):
        p.report_attempt(spec, Attempt(LOCAL))
        p.report_attempt(spec, Attempt(OK, 404))
    assert spec.outlier == OutlierState()


def test_backend_states_are_one_hot_and_up_follows_them():
    p = up(pools())
    spec, base = p.by_url[S1], p.by_url[B1]
    base.healthy = False
    assert (spec.state(), base.state()) == ("up", "down")
    base.healthy = True
    for _ in range(3):
        p.report_attempt(spec, Attempt(IDLE_TIMEOUT))
    assert spec.state() == EJECTED


@pytest.mark.parametrize(("exc", "cls"), [
    (ConnectFailed(OSError(errno.EMFILE, "Too many open files")), UpstreamLocalError),
    (ConnectFailed(OSError(errno.EADDRNOTAVAIL, "no ports")), UpstreamLocalError),
    (ConnectFailed(socket.gaierror(-3, "Temporary failure in name resolution")), UpstreamLocalError),
    (ConnectFailed(ConnectionRefusedError(errno.ECONNREFUSED, "refused")), UpstreamConnectError),
    (ConnectFailed(OSError(errno.EHOSTUNREACH, "no route")), UpstreamConnectError),
])
def test_map_error_tells_local_errors_from_the_backends(exc, cls):
    err = map_error(exc, "http://b:1", FIRST_BYTE, got_headers=False)
    assert type(err) is cls
    assert err.retryable  # the request never left
    if cls is UpstreamLocalError:
        assert err.kind == "local" and err.status == 503 and "router could not connect" in err.message
