"""Accept-length drift: when a speculative server's reported accept length moves for good (prompt mix, drafter),
its token time scales inversely, at once. The figure is a window average that jitters with the running mix, so a
move counts only against an anchor (a mean of figures), beyond a jump the mix alone does not explain, on several
polls in a row."""
from __future__ import annotations

import math

from router.tuning import DEFAULT, Tuning


class AcceptDrift:
    """Per backend URL: the last figure, the anchor a jump is judged against, the polls beyond it in a row, the
    figures folded into the anchor and their mean squared relative deviation from it (per request)."""

    def __init__(self, tuning: Tuning = DEFAULT) -> None:
        self.t = tuning
        self.accept: dict[str, float] = {}  # accept length each backend last reported
        self.anchor: dict[str, float] = {}
        self.beyond: dict[str, int] = {}
        self.polls: dict[str, int] = {}  # figures folded into each anchor since it was (re)set, up to anchor_polls
        self.accept_dev: dict[str, float] = {}

    def poll(self, url: str, x: float, running: int, spread: float) -> float | None:
        """One reported accept length `x` with `running` requests; `spread`: the model's per-request spread.
        Returns the factor the token time scales by when it drifted, else None."""
        t = self.t
        self.accept[url] = x
        if running < t.accept_min_running:
            return None
        # Against the anchor (a mean of figures, reset to the new one at a rescale), not the last one reported: a
        # figure that jitters must not walk the model away in sub-threshold steps. (The anchor exists once a
        # figure has been folded: k >= 1.)
        anchor, k = self.anchor.get(url, 0.0), self.polls.get(url, 0)
        if k < t.anchor_polls or abs(x - anchor) <= self.jump(url, spread, running) * anchor:
            self.fold(url, x, running)
            return None
        if (beyond := self.beyond.get(url, 0) + 1) < t.accept_polls:
            self.beyond[url] = beyond
            return None
        self.anchor[url], self.beyond[url], self.polls[url], self.accept_dev[url] = x, 0, 1, 0.0
        return anchor / x

    def fold(self, url: str, x: float, running: int) -> None:
        """One figure within the jump: the anchor is the mean of the first anchor_polls, then moves 1/anchor_polls
        toward each; so does the figures' mean squared relative deviation from it, times the requests running (a
        mean of more requests' draws scatters less: per request, as the spread term)."""
        self.beyond[url] = 0
        k = self.polls[url] = min(self.polls.get(url, 0) + 1, self.t.anchor_polls)
        anchor = self.anchor.get(url, x)
        anchor += (x - anchor) / k
        self.anchor[url] = anchor
        dev = self.accept_dev.get(url, 0.0)
        self.accept_dev[url] = dev + ((x / anchor - 1.0) ** 2 * running - dev) / k

    def jump(self, url: str, spread: float, running: int) -> float:
        """How far (relative) the figure must move to be a change of the server's own: accept_jump, or accept_z
        times what its running mix alone moves it by (the model's spread, or the figures' own scatter around the
        anchor, per request), over the square root of the requests running, whichever is largest."""
        spread = max(spread, math.sqrt(self.accept_dev.get(url, 0.0)))
        return max(self.t.accept_jump, self.t.accept_z * spread / math.sqrt(max(running, 1)))
