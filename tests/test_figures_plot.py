"""The plot a person reads (bench.figures.figure): every panel's title, axis labels and the legend, checked on
matplotlib's own objects, for closed and open loop."""
from __future__ import annotations

import pytest

from bench import figures

pytestmark = pytest.mark.timeout(60)

plt = pytest.importorskip("matplotlib.pyplot")


def _level(conc: float, tput: float, open_loop: bool = False) -> dict:
    key = {"request_rate": conc, "concurrency": None} if open_loop else {"concurrency": conc}
    return {**key, "output_throughput": tput, "median_ttft_ms": 10.0 * conc, "mean_itl_ms": 5.0 + conc}


def _labels(fig) -> list[tuple[str, str, str]]:
    return [(ax.get_title(), ax.get_xlabel(), ax.get_ylabel()) for ax in fig.axes]


def test_every_panel_is_titled_and_labelled_with_its_quantity_and_the_legend_names_the_deployments():
    results = {"tp8-baseline": [_level(1, 90), _level(4, 250)], "split+balanced": [_level(1, 50), _level(4, 160)]}
    fig = figures.figure(results, title="the same 8 GPUs", gpus={"tp8-baseline": 8, "split+balanced": 8})
    try:
        x = "concurrent clients (log scale)"
        assert _labels(fig) == [("Output throughput", x, "output throughput (tok/s)"),
                                ("Time to first token (median)", x, "median TTFT (ms, log scale)"),
                                ("Inter-token latency (mean)", x, "mean ITL (ms)")]
        assert fig._suptitle.get_text() == "the same 8 GPUs"
        legend = fig.axes[0].get_legend()
        assert legend.get_title().get_text() == "deployment"
        assert [t.get_text() for t in legend.get_texts()] == ["tp8-baseline [8 GPUs]", "split+balanced [8 GPUs]"]
        # each panel draws one line per deployment, named the same
        for ax in fig.axes:
            assert [line.get_label() for line in ax.get_lines()] == ["tp8-baseline [8 GPUs]",
                                                                     "split+balanced [8 GPUs]"]
        assert [ax.get_yscale() for ax in fig.axes] == ["linear", "log", "linear"]
        assert list(fig.axes[0].get_lines()[0].get_ydata()) == [90, 250]
    finally:
        plt.close(fig)


def test_open_loop_axes_say_request_rate_and_names_without_gpus_stay_plain():
    fig = figures.figure({"sim": [_level(2, 10, True), _level(8, 30, True)]})
    try:
        assert {ax.get_xlabel() for ax in fig.axes} == {"request rate (req/s, log scale)"}
        assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["sim"]
        assert fig._suptitle is None
    finally:
        plt.close(fig)


def test_plot_writes_that_figure_as_png(tmp_path):
    png = figures.plot(tmp_path / "x.png", {"sim": [_level(1, 10), _level(2, 20)]}, title="t")
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert plt.get_fignums() == []  # closed after saving


def test_the_drift_plot_is_titled_and_labelled(tmp_path, monkeypatch):
    from bench.lab import drift

    seen = []
    real_close = plt.close

    def spy(fig=None):
        if fig is not None and not isinstance(fig, str):
            seen.append([(ax.get_title(), ax.get_xlabel(), ax.get_ylabel()) for ax in fig.axes])
        real_close(fig)

    monkeypatch.setattr(plt, "close", spy)
    samples = [{"t": t, "tok_s": 100.0 + t, "spec_share": 0.5} for t in range(5)]
    drift.plot(tmp_path / "d.png", {"adaptive": samples, "balanced": samples}, before=2.0)
    assert seen == [[("Output throughput", "", "output tok/s"),
                     ("Tokens served by the speculative pool", "simulated seconds (dashed: acceptance drops)",
                      "speculative share of tokens (%)")]]
