"""Infers a backend's queue limit (how many requests it runs at once) from when its requests' first tokens come."""
from __future__ import annotations

from router.tuning import DEFAULT

# A backend that reports no max_running_requests (no /v1/loads: llama.cpp, vLLM; or load_signal local) is taken to
# run at most the largest number of requests it was seen running at once, once Tuning.queue_witnesses requests in a row
# that could have shown it running more did not. A request ran beside those of the others on it that were
# streaming when its own first token came; it could have shown more when others were in flight as it was sent.
# A batching server shows no more than the most seen so far only when the others end (or have not yet started)
# during the new request's time to first token: a chance of about that time over a request's duration (~0.15 with
# long prompts); at 0.2, three in a row is under 1%, and one request seen running beside more lifts the figure
# again. A serial engine (one request at a time) shows its second request's first token after the first's last.


class QueueWitness:
    """The most requests one backend was seen running at once, and how many requests since could have shown more
    and did not."""

    __slots__ = ("most", "tries", "witnesses")

    def __init__(self, witnesses: int = DEFAULT.queue_witnesses) -> None:
        self.most = 1
        self.tries = 0
        self.witnesses = witnesses

    def note(self, at_start: int, beside: int) -> None:
        """One request's first token: it was sent with `at_start` in flight on the backend (itself included), and
        `beside` others there were streaming when its first token came."""
        seen = 1 + beside
        if seen > self.most:
            self.most, self.tries = seen, 0
        elif at_start > self.most:
            self.tries += 1

    def limit(self) -> int | None:
        """The inferred limit, None while the requests that could have shown more are too few."""
        return self.most if self.tries >= self.witnesses else None
