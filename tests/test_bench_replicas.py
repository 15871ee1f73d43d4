"""`python -m bench replicas`: several router replicas on the same simulators, backend vs local load signal."""
from __future__ import annotations

import csv
import json

import pytest

from bench.__main__ import main as bench_main
from bench.lab import replicas
from tests.fixtures_epp import need_epp


# epp: the replicas are pickers behind one Envoy; the same agreement through /v1/loads must hold.
@pytest.mark.timeout(300)
@pytest.mark.parametrize("front", ["proxy", pytest.param("epp", marks=need_epp)])
def test_replicas_small_run(tmp_path, capsys, front):
    out = tmp_path / "rep"
    rc = replicas.main(["--front", front, "--replicas", "2", "--speculative", "1", "--baseline", "1", "--threshold", "2",
                        "--concurrency", "12", "--duration", "4", "--ramp", "0.5", "--max-tokens", "24", "--speedup", "1",
                        "--load-interval", "0.2", "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0
    assert "| `backend` |" in printed and "| `local` |" in printed
    doc = json.loads((out / "replicas.json").read_text())
    rows = {r["signal"]: r for r in doc["figures"]}
    backend, local = rows["backend"], rows["local"]
    for r in (backend, local):
        assert r["pool_limit"] == 2 and r["samples"] > 10 and r["errors"] == 0 and r["requests_ok"] > 0
        assert 0 < r["speculative_share"] < 1, "the speculative pool served and the rest spilled over"
    # Each local replica fills the speculative instance to the threshold on its own: 2 replicas, twice over.
    assert local["max_running"] > local["pool_limit"]
    # Replicas that read /v1/loads keep the pool lower on average than replicas that count only their own.
    assert backend["mean_running"] < local["mean_running"]
    with (out / "replicas.csv").open() as fh:
        samples = list(csv.DictReader(fh))
    assert {s["signal"] for s in samples} == {"backend", "local"}
    assert max(int(s["pool_running"]) for s in samples if s["signal"] == "local") == local["max_running"]
    assert (out / "replicas.md").read_text().strip() in printed


@pytest.mark.parametrize(("argv", "fragment"), [
    (["--signals", "both"], "--signals"), (["--replicas", "0"], "--replicas"),
    (["--duration", "0"], "--duration"), (["--duration", "5", "--ramp", "5"], "--ramp"), (["--load-interval", "-1"], "--load-interval"),
    (["--concurrency", "x"], "invalid int"), (["--front", "gateway"], "--front"), (["--prompts", "/nonexistent.jsonl"], "nonexistent")])
def test_replicas_bad_flags_are_one_line(argv, fragment, capsys):
    assert bench_main(["replicas", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert fragment in err and "\n" not in err and err.startswith("spec-bench replicas:")


def test_figures_from_samples():
    cfg = replicas.Config(speculative=2, threshold=8, duration=40)
    run = replicas.SignalRun("local", samples=[(0.5, 10), (4.5, 20), (5.0, 48), (39.9, 16)], per_instance_max=24)
    f = replicas.figures(cfg, run)
    assert (f["pool_limit"], f["max_running"], f["overshoot_max"], f["instance_max"]) == (16, 48, 32, 24)
    assert f["share_above"] == 0.5 and f["mean_running"] == 23.5
    assert f["timeline_max"] == [10, 48, None, None, None, None, None, None, None, 16] and f["window_s"] == 4
    text = replicas.render(cfg, [f])
    assert "| `local` | 16 | 23.5 | 48 | 32 |" in text
    assert "| `local` | 10 | 48 | - | - | - | - | - | - | - | 16 |" in text
