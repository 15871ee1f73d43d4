"""`python -m bench stress` and `python -m bench faults` end to end (subprocesses on loopback), small and fast."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench import streams
from bench.lab import faultmatrix, stress
from bench.load import RequestRecord


def test_stress_small_run_accounts_for_every_request(tmp_path):
    out = tmp_path / "stress.json"
    rc = stress.main(["--streams", "40", "--duration", "2", "--ramp", "0.2", "--speedup", "50",
                      "--disconnect-fraction", "0.2", "--json", str(out)])
    res = json.loads(out.read_text())
    c = res["client"]
    assert c["sent"] == c["completed"] + c["failed_explicit"] + c["disconnected_on_purpose"]
    assert c["unaccounted"] == 0 and c["disconnected_on_purpose"] > 0 and c["peak_open_streams"] == 40
    assert set(res["router"]["inflight_after"].values()) == {0}
    sims = res["simulators"].values()
    assert sum(s["aborted_total"] for s in sims) + sum(s["completed_total"] for s in sims) == (
        c["completed"] + c["disconnected_on_purpose"])
    assert res["router"]["client_disconnects"] == c["disconnected_on_purpose"]
    # The router's own count of answers (by status, from its /metrics) against what the clients saw.
    assert res["router"]["answered"] == c["sent"]
    assert res["router"]["by_status"].get("499", 0) == c["disconnected_on_purpose"]
    assert res["router"]["by_status"].get("200", 0) == c["completed"] + c["failed_explicit"]
    assert set(res["router"]["inflight_after"].values()) == {0}
    assert all(s["running"] == 0 and s["queued"] == 0 for s in sims)
    # 40 idle-ish streams in a Python process: tens of MB; hundreds would be a leak.
    assert 10 < res["router"]["peak_rss_mb"] < 400
    assert res["router"]["exit_code"] == 0
    # The verdict the tool prints follows from those facts (every one of them checked above).
    assert rc == 0 and res["ok"] is True


def test_faults_row_runs_and_reports_the_client_view(tmp_path, capsys):
    out = tmp_path / "faults.json"
    rc = faultmatrix.main(["--rows", "error503", "--speedup", "20", "--json", str(out)])
    printed = capsys.readouterr().out
    (row,) = json.loads(out.read_text())
    assert "| backend answers 503 |" in printed
    assert row["unaccounted"] == 0 and row["completed"] == row["sent"] > 0
    # Every 503 retried on the other pool (clients see none), and five in a row eject the backend.
    assert row["failover_s"] is not None and row["detect_s"] is not None
    assert set(row["gauges_after"].values()) == {0}
    # Only now, with the facts checked independently, the tool's own verdict must agree with them.
    assert rc == 0 and "RESULT: PASS" in printed


@pytest.mark.parametrize(("cmd", "args", "text"), [
    ("stress", ["--streams", "0"], "--streams must be"),
    ("stress", ["--disconnect-fraction", "2"], "--disconnect-fraction"),
    ("stress", ["--bogus"], "unrecognized arguments"),
    ("faults", ["--rows", "nope"], "unknown row 'nope'"),
    ("faults", ["--speedup", "-1"], "--speedup"),
])
def test_bad_flags_are_one_line_and_exit_2(cmd, args, text):
    p = subprocess.run([sys.executable, "-m", "bench", cmd, *args], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert text in p.stderr and len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr


@pytest.mark.parametrize(("rec", "outcome"), [
    (RequestRecord(start=0, error=None, done=True), stress.OK),
    (RequestRecord(start=0, error="HTTP 504: upstream timeout"), stress.EXPLICIT),
    (RequestRecord(start=0, error="stream error: backend closed", done=True), stress.EXPLICIT),
    (RequestRecord(start=0, error="stream error: backend closed", done=False), stress.UNACCOUNTED),
    (RequestRecord(start=0, error="stream ended without [DONE]"), stress.UNACCOUNTED),
    (RequestRecord(start=0, error="connection error: ClientPayloadError"), stress.UNACCOUNTED),
])
def test_only_a_status_or_an_error_event_before_done_counts_as_explicit(rec, outcome):
    assert streams.classify(rec) == outcome


def test_fd_limit_is_raised_for_thousands_of_streams():
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, 9000)
    try:
        assert stress.raise_fd_limit(want) >= want
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= want
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
