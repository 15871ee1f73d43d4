"""What the proxy tells the pools about each upstream attempt and each finished exchange (the learning seam)."""
from __future__ import annotations

import time
from dataclasses import dataclass

from router.errors import Failure

# Outcome kinds of one upstream attempt, a closed set (they may become metric label values).
# "ok": response headers came back with a status; the rest name how the attempt failed (router.errors.Failure).
OK = "ok"
REFUSED, CONNECT_TIMEOUT, FIRST_BYTE_TIMEOUT, IDLE_TIMEOUT, DISCONNECTED, LOCAL = (
    Failure.REFUSED, Failure.CONNECT_TIMEOUT, Failure.FIRST_BYTE_TIMEOUT, Failure.IDLE_TIMEOUT,
    Failure.DISCONNECTED, Failure.LOCAL)
ATTEMPT_KINDS: tuple[str, ...] = (OK, *Failure)


@dataclass(frozen=True, slots=True)
class Attempt:
    """One upstream attempt on one backend: `status` is the HTTP status when headers came back (kind "ok"),
    else None. `LOCAL` is a failure of ours (out of file descriptors, DNS), never the backend's fault."""

    kind: str
    status: int | None = None


@dataclass(frozen=True, slots=True)
class Observation:
    """One finished exchange on one backend, as the router saw it (inputs for learned policies).

    inflight_at_start/end: the backend's in-flight count (this request included) when the lease was taken and
    just before it was released. ttft_s: seconds to the first streamed chunk (None when not streamed).
    completion_tokens: from the usage the backend reported (None when it reported none). ok: the backend
    finished the answer (2xx and complete); False for errors, aborts and client disconnects."""

    pool: str
    url: str
    inflight_at_start: int
    inflight_at_end: int
    duration_s: float
    ttft_s: float | None
    completion_tokens: int | None
    chunks: int
    ok: bool
    # The backend's mean in-flight count over the exchange (time-weighted, this request included); None when
    # not measured. Start and end counts misstate the load of a request that ran while it ramped or drained.
    inflight_mean: float | None = None
    # From the usage: prompt tokens, and the cached ones when the backend reports them (None: not reported).
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    # What the router's prefix index expected cached there (router.affinity), for a backend reporting none.
    expected_cached_tokens: int | None = None
    # The router's estimate of the prompt's tokens from its bytes (router.affinity), for a backend reporting no
    # usage (llama-cpp-python); None with prefix routing off, or for a prompt that is not text.
    estimated_prompt_tokens: int | None = None
    # SSE `data:` events of a stream ([DONE] included; 0 when not streamed): an engine that sends no usage chunk
    # (llama-cpp-python ignores stream_options) sends one token per event, so it counts its tokens there.
    data_events: int = 0
    # Other requests on the backend running (streams past their first token, requests not streamed) when this
    # one's first token came (None: no first token): with inflight_at_start, whether it waited (router.queuelimit).
    running_beside: int | None = None
    # Seconds from its start to the latest release of another request on the backend before its first token
    # (None: none, or no first token): with one place on the backend, its wait.
    waited_s: float | None = None

    def tokens(self) -> int | None:
        """Completion tokens: the usage's, else a stream's data events but [DONE] (None when neither is known)."""
        if self.completion_tokens is not None:
            return self.completion_tokens
        return self.data_events - 1 if self.ttft_s is not None and self.data_events > 1 else None


@dataclass(frozen=True, slots=True)
class LoadFigures:
    """What one /v1/loads answer says about a backend (summed over data-parallel ranks)."""

    running: int
    waiting: int
    gen_throughput: float | None = None  # output tok/s of the whole server
    accept_length: float | None = None  # mean accepted tokens per speculative step
    max_running: int | None = None  # SGLang's max_running_requests: beyond it requests wait
    max_total_tokens: int | None = None  # max_total_num_tokens: KV capacity, prefix cache included
    cache_hit_rate: float | None = None  # cached share of the prompt tokens of its last prefill step


def finished(lease, usage, *, inflight_at_start: int, t0: float, ttft: float | None, chunks: int, ok: bool,
             data_events: int) -> Observation:
    """A finished exchange as both front ends (router.exchange, router.epp.decide) report it at its lease's end:
    `usage` (router.streaming.Usage) gives the tokens when one came; what ran beside it and its wait for a place
    are read at its first token, so a stream's only."""
    b = lease.backend
    u = usage
    streamed = ttft is not None
    return Observation(
        b.pool, b.url, inflight_at_start, b.inflight, time.monotonic() - t0, ttft,
        u.completion if u.seen else None, chunks, ok, lease.mean_inflight(),
        u.prompt if u.seen else None, u.cached, data_events=data_events,
        running_beside=lease.beside if streamed else None,
        waited_s=lease.waited if streamed else None)  # cached: None until a usage came
