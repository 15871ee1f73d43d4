"""bench drift: its flags, its summary arithmetic, and (with the simulator's drift endpoint) one short run."""
from __future__ import annotations

import argparse

import pytest

from bench.lab import drift


def ns(**kw):
    base = {"before": 100.0, "after": 100.0}
    return argparse.Namespace(**(base | kw))


def series(pre: float, post: float, *, settle_at: float = 0.0, share: float = 0.3) -> list[dict]:
    out = []
    for t in range(10, 201, 10):
        drifted = t > 100
        tok = pre if not drifted else (post if t - 100 >= settle_at else post * 0.7)
        out.append({"t": float(t), "tok_s": tok, "spec_share": share, "drifted": drifted})
    return out


def test_summary_and_recovery_time():
    runs = {"adaptive": series(1000, 990, settle_at=30), "balanced-pre": series(1000, 800),
            "balanced-post": series(900, 1000)}
    s = drift.summarize(ns(), runs)
    assert s["balanced-post"]["post_tok_s"] == 1000 and s["balanced-pre"]["post_vs_balanced_post"] == 0.8
    assert s["adaptive"]["pre_tok_s"] == 1000 and s["adaptive"]["post_vs_balanced_post"] == 0.99
    assert s["adaptive"]["recovered_after_s"] == 30.0  # the first window from which it holds 0.95x
    never = drift.summarize(ns(), runs | {"adaptive": series(1000, 800)})
    assert never["adaptive"]["recovered_after_s"] is None


def test_tokens_by_pool_reads_the_router_counter():
    text = ('# TYPE router_completion_tokens_total counter\n'
            'router_completion_tokens_total{pool="speculative"} 120.0\n'
            'router_completion_tokens_total{pool="baseline"} 3.0\n'
            'router_prompt_tokens_total{pool="baseline"} 99.0\n')
    assert drift._tokens_by_pool(text) == {"speculative": 120.0, "baseline": 3.0}


@pytest.mark.parametrize("argv, fragment", [
    (["--configs", "nope"], "unknown configuration"),
    (["--speedup", "0"], "must be positive"),
    (["--speculative-profile", "baseline-tp8"], "not a speculative profile"),
    (["--speculative-profile", "no-such"], "no-such"),
    (["--concurrency", "x"], "invalid int"),
])
def test_bad_flags_are_one_line(argv, fragment, capsys):
    assert drift.main(argv) == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1
