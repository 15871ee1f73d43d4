"""bench modelcheck: replaying recorded samples through the speed models (pure), and the recording CLI."""
from __future__ import annotations

import json
import random

import pytest

from bench.lab import modelcheck
from router.adaptive import sample
from router.observe import Observation

AB = (0.01, 0.001)  # seconds per token per request: alpha + beta * n


def synthetic(count: int, rng: random.Random, step_at: int | None = None, factor: float = 1.0):
    """Samples of one pool at random loads with 10% noise; from `step_at` on the server is `factor` slower."""
    out = []
    for i in range(count):
        n = float(rng.randint(1, 60))
        slow = factor if step_at is not None and i >= step_at else 1.0
        y = (AB[0] + AB[1] * n) * slow * (1 + rng.gauss(0, 0.1))
        out.append(("baseline", n, y, "after" if step_at is not None and i >= step_at else "before"))
    return out


NO_FORGETTING = "a+b*n without forgetting (128 samples per band)"


def median(result, name, key):
    return result[name][key]["median"]


def test_a_load_aware_fit_beats_load_blind_averages_on_varying_load():
    samples = synthetic(400, random.Random(1))
    models = modelcheck.variants({"baseline": AB})
    res = {name: modelcheck.summary(modelcheck.replay(samples, make)) for name, make in models.items()}
    fitted = median(res, "adaptive: a+b*n, robust, forgetting 0.99", "baseline/before")
    assert fitted < 0.1  # about the noise itself
    for blind in ("EWMA of per-request tok/s (no load term)", "EWMA of per-pool tok/s"):
        assert median(res, blind, "baseline/before") > 2 * fitted
    # the true curve, given as the fixed calibration, is as good as it gets before any change
    assert median(res, "fixed curve (calibrated before the run)", "baseline/before") < 0.1


def test_after_a_step_change_forgetting_follows_and_the_fixed_curve_does_not():
    samples = synthetic(500, random.Random(2), step_at=300, factor=1.6)
    models = modelcheck.variants({"baseline": AB})
    # judged on the 200 samples after the change (128 per band are held: it forgets within those alone)
    res = {name: modelcheck.summary(modelcheck.replay(samples, make)) for name, make in models.items()}
    forgetting = median(res, "adaptive: a+b*n, robust, forgetting 0.99", "baseline/after")
    assert forgetting < 0.2
    assert median(res, NO_FORGETTING, "baseline/after") > 1.3 * forgetting
    assert median(res, "fixed curve (calibrated before the run)", "baseline/after") > 0.3


def test_replay_predicts_each_sample_from_the_earlier_ones_only():
    class Last:
        def __init__(self):
            self.y = float("nan")

        def predict(self, n):
            return self.y

        def update(self, n, y):
            self.y = y

    samples = [("a", 1.0, 1.0, "x"), ("a", 1.0, 2.0, "x"), ("b", 1.0, 4.0, "x"), ("a", 1.0, 1.0, "x")]
    errs = modelcheck.replay(samples, lambda pool: Last())
    # a: 1 -> 2 (error 1/2), 2 -> 1 (error 1); b's first sample has no prediction
    assert errs == {("a", "x"): [0.5, 1.0]}


@pytest.mark.parametrize(("obs", "limit", "want"), [
    # the whole duration over the tokens, first token included: 2.0 / 100 at (4 + 6) / 2 running
    (Observation("speculative", "u", 4, 6, 2.0, 0.2, 100, 10, True), None, (5.0, 0.02)),
    # sent 4th to a server that runs 3: it waited, then decoded in a full batch; from its first token on,
    # (2.0 - 0.2) / 99 s per token, at the cap
    (Observation("speculative", "u", 4, 6, 2.0, 0.2, 100, 10, True), 3, (3.0, 1.8 / 99)),
    (Observation("speculative", "u", 1, 1, 2.5, 0.5, 100, 10, True), None, (1.0, 0.025)),  # slow start counts
    # ramped from 5 to 52 but ran with 48 on time average: the mean is the load, not (5 + 52) / 2
    (Observation("speculative", "u", 5, 52, 2.0, 0.2, 100, 10, True, 48.0), None, (48.0, 0.02)),
    # ... sent 5th to a server that runs 40: it ran at once, in a batch that filled: its own time, at the cap
    (Observation("speculative", "u", 5, 52, 2.0, 0.2, 100, 10, True, 48.0), 40, (40.0, 0.02)),
    (Observation("baseline", "u", 1, 1, 1.0, None, 50, 0, True), None, (1.0, 0.02)),  # not streamed
    (Observation("baseline", "u", 1, 1, 1.0, 0.1, 50, 10, False), None, None),  # failed
    (Observation("baseline", "u", 1, 1, 1.0, 0.1, 1, 1, True), None, None),  # one token says nothing
    (Observation("baseline", "u", 1, 1, 0.1, 0.2, 50, 10, True), None, None),  # first chunk after the end
])
def test_sample_of_an_observation(obs, limit, want):
    got = sample(obs, limit)
    assert got == (pytest.approx(want) if want is not None else None)


def test_modelcheck_cli_replays_a_recording_and_rejects_bad_input(tmp_path, capsys):
    obs = []
    rng = random.Random(3)
    for i in range(120):
        n = rng.randint(1, 40)
        dur = 0.1 + 100 * (AB[0] + AB[1] * n)
        obs.append({"pool": "baseline", "url": "u", "inflight_at_start": n, "inflight_at_end": n,
                    "duration_s": dur, "ttft_s": 0.1, "completion_tokens": 100, "chunks": 100, "ok": True,
                    "phase": "before", "t": i})
    path = tmp_path / "rec.json"
    path.write_text(json.dumps({"observations": obs, "max_running": {"baseline": 64},
                                "fixed": {"baseline": list(AB)}}))
    assert modelcheck.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "119 samples" not in out and "120 samples" in out
    assert "| adaptive: a+b*n, robust, forgetting 0.99 |" in out and "baseline/before" in out
    assert modelcheck.main([str(tmp_path / "missing.json")]) == 2
    assert modelcheck.main(["x.json", "--levels", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 2 and "Traceback" not in err
