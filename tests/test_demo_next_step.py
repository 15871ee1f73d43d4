"""The demo as a newcomer meets it: its plot's titles and labels, and the next step it prints runs when pasted
into a shell as printed (spec-bench when that is on PATH, else the venv's python by path)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import demo, figures

pytestmark = pytest.mark.timeout(240)

DEPLOYMENTS = ["tp8-baseline", "split+balanced", "colocated+global", "tp8-eagle3", "tp8-adaptive"]


def _pasted(out: str) -> str:
    lines = out.splitlines()
    i = lines.index("next, what to run on these GPUs by load:")
    return lines[i + 1].strip()


def test_demo_plot_is_labelled_and_its_next_step_runs_as_printed(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    seen = []
    real = figures.figure

    def spy(results, title="", gpus=None):
        fig = real(results, title, gpus)
        seen.append(([(ax.get_title(), ax.get_xlabel(), ax.get_ylabel()) for ax in fig.axes],
                     [t.get_text() for t in fig.axes[0].get_legend().get_texts()], fig._suptitle.get_text()))
        return fig

    monkeypatch.setattr(figures, "figure", spy)
    monkeypatch.chdir(tmp_path)
    rc = demo.main(["--concurrency", "1,2", "--max-tokens", "16", "--speedup", "10", "--out", "out"])
    out = capsys.readouterr().out
    assert rc == 0
    assert plt.get_fignums() == []
    (panels, legend, title), = seen
    x = "concurrent clients (log scale)"
    assert panels == [("Output throughput", x, "output throughput (tok/s)"),
                      ("Time to first token (median)", x, "median TTFT (ms, log scale)"),
                      ("Inter-token latency (mean)", x, "mean ITL (ms)")]
    assert legend == [f"{d} [8 GPUs]" for d in DEPLOYMENTS]
    # `spec-bench --help` counts them as the run does
    from bench.__main__ import usage

    assert len(DEPLOYMENTS) == 5 and "the same 8 simulated GPUs five ways (" in usage()
    assert title == "spec-bench demo: the same 8 GPUs (simulated), five deployments (eagle3-good, compose)"
    assert (tmp_path / "out" / "demo.png").read_bytes()[:4] == b"\x89PNG"
    # Pasted into a shell in the same directory, with the user's PATH (not this venv's bin unless it is on it).
    line = _pasted(out)
    assert line.endswith("-m bench plan out/demo.json") or line == "spec-bench plan out/demo.json", line
    r = subprocess.run(line, shell=True, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 0, (line, r.stderr[-1500:])
    assert r.stdout.split()[0] in ("RUN", "Beats")


def test_next_step_says_spec_bench_when_this_environments_is_on_path(tmp_path, monkeypatch):
    bindir = Path(sys.executable).parent
    monkeypatch.chdir(tmp_path)
    if (bindir / "spec-bench").exists():
        monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}/usr/bin:/bin")
        assert demo.next_step(Path("d/demo.json")).splitlines()[1] == "  spec-bench plan d/demo.json"
    # Not on PATH: this interpreter by its path (absolute here: it is not under the current directory).
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    lines = demo.next_step(Path("d/my demo.json")).splitlines()
    assert lines[1] == f"  {sys.executable} -m bench plan 'd/my demo.json'"
