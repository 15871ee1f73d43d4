"""router.watchdog's two deadlines on a simulated clock: no wall-clock time passes and nothing is timed.

The watchdog reads the time through its module's `time.monotonic` and re-arms itself through the running loop's
`call_later`; both are replaced here by a discrete-event clock, so each check runs at an exact simulated instant
and the documented guarantees can be checked as plain arithmetic: the idle timeout fires once the backend has
been quiet for `idle` seconds (and not while chunks keep coming), and a client that stopped reading is cut off
between `write_timeout` and 1.5 x `write_timeout` after its last read (and not while it keeps reading). Each
docstring names the mutmut mutants of router/watchdog.py it kills (`bash scripts/mutation.sh router/watchdog.py`).
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import types
from collections.abc import Callable

import pytest

from router import watchdog


class Clock:
    """A loop stand-in: call_later queues (due, callback); run() fires them in order, advancing `now`."""

    def __init__(self) -> None:
        self.now = 0.0
        self._queue: list = []
        self._seq = itertools.count()
        self.events: list[tuple[float, Callable[[], None]]] = []  # test actions at given instants

    def monotonic(self) -> float:
        return self.now

    def call_later(self, delay: float, callback: Callable[[], None]) -> types.SimpleNamespace:
        handle = types.SimpleNamespace(cancelled=False)
        handle.cancel = lambda: setattr(handle, "cancelled", True)
        # Real time moves on between two callbacks: a delay too small to change a float still lands later.
        due = max(self.now + delay, math.nextafter(self.now, math.inf))
        heapq.heappush(self._queue, (due, next(self._seq), callback, handle))
        return handle

    def at(self, when: float, action: Callable[[], None]) -> None:
        self.events.append((when, action))

    def run(self, until: float) -> None:
        for when, action in sorted(self.events, key=lambda e: e[0]):
            heapq.heappush(self._queue, (when, next(self._seq), action, types.SimpleNamespace(cancelled=False)))
        self.events.clear()
        while self._queue and self._queue[0][0] <= until:
            due, _, callback, handle = heapq.heappop(self._queue)
            self.now = due
            if not handle.cancelled:
                callback()
        self.now = until

    def armed(self) -> int:
        return sum(1 for *_, h in self._queue if not h.cancelled)


class Client:
    """The client connection's write side as the watchdog sees it: bytes written so far, bytes still queued."""

    def __init__(self, clock: Clock, written: Callable[[float], int], taken: Callable[[float], int]) -> None:
        self.clock, self.written, self.taken = clock, written, taken
        self.aborted_at: float | None = None
        self.closed_at = math.inf  # when someone else (aiohttp) starts closing it

    @property
    def output_size(self) -> int:  # the aiohttp StreamWriter's running byte count
        return self.written(self.clock.now)

    def get_write_buffer_size(self) -> int:
        return self.written(self.clock.now) - self.taken(self.clock.now)

    def is_closing(self) -> bool:
        return self.aborted_at is not None or self.clock.now >= self.closed_at

    def abort(self) -> None:
        assert self.aborted_at is None, "aborted twice"
        self.aborted_at = self.clock.now


class Upstream:
    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.failed_at: list[float] = []

    def time_out(self) -> None:  # router.upstream.Reply's
        self.failed_at.append(self.clock.now)


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(watchdog, "time", types.SimpleNamespace(monotonic=c.monotonic))
    monkeypatch.setattr(watchdog, "asyncio", types.SimpleNamespace(get_running_loop=lambda: c))
    return c


def make(clock: Clock, idle: float, write_timeout: float, written, taken):
    client, upstream = Client(clock, written, taken), Upstream(clock)
    dog = watchdog.Watchdog(idle, write_timeout, client, client, upstream)
    return dog, client, upstream


def chunk_at(clock: Clock, dog: watchdog.Watchdog, *times: float) -> None:
    for t in times:
        clock.at(t, lambda: setattr(dog, "last_chunk", clock.now))


def all_taken(t: float) -> int:
    return 100


# ---------------------------------------------------------------- idle: the backend's silence

def test_idle_fires_once_after_idle_seconds_of_silence_and_not_while_chunks_come(clock):
    """Chunks every 0.6 s with idle 1 s: no timeout; the last at 1.8 s: the timeout at 2.8 s exactly, once.
    mutmut: _check 6 (`now + last_chunk`: fires at the first check), 14 (`min(wait, )`: TypeError), 15
    (`idle + quiet`: the next check too late, fires at 4.0), 9 (`_resp = ""` after firing: the next check fails)."""
    dog, client, upstream = make(clock, 1.0, 10.0, all_taken, all_taken)
    chunk_at(clock, dog, 0.6, 1.2, 1.8)
    clock.run(until=2.7)
    assert upstream.failed_at == []
    clock.run(until=60.0)
    assert upstream.failed_at == [pytest.approx(2.8)]
    assert client.aborted_at is None and clock.armed() == 1  # still watching the write side


def test_idle_fires_at_the_check_that_finds_idle_seconds_of_silence(clock):
    """No chunk since the start, idle 1 s: the check armed for 1.0 s finds exactly 1 s of silence and fires then,
    not at a zero-delay check after it. mutmut: _check 7 (`quiet > self._idle`: a boundary the simulated clock
    reaches exactly)."""
    dog, client, upstream = make(clock, 1.0, 10.0, all_taken, all_taken)
    clock.run(until=60.0)
    assert upstream.failed_at == [1.0]


def test_after_the_upstream_is_done_only_the_write_deadline_is_left(clock):
    """The backend finished at 0.2 s; its silence is no timeout, but a client that stops reading still is.
    mutmut: upstream_done 1 (`_resp = ""`: the idle branch then fails on a str and the watchdog dies, so the
    stalled client is never cut off)."""
    dog, client, upstream = make(clock, 1.0, 1.0, lambda t: 500, lambda t: 100 * min(t, 3.0))
    clock.at(0.2, dog.upstream_done)
    clock.run(until=30.0)
    assert upstream.failed_at == []
    assert client.aborted_at is not None and 3.0 + 1.0 <= client.aborted_at <= 3.0 + 1.5


# ---------------------------------------------------------------- write: the client's reading

@pytest.mark.parametrize("stops", [0.4, 3.0, 7.3])
def test_a_client_that_stops_reading_is_cut_between_one_and_one_and_a_half_write_timeouts(clock, stops):
    """The router keeps writing; the client reads everything until `stops`, then nothing. mutmut: __init__ 5
    (`write_timeout * 2` between checks: cut too late), 11 (`_sent = None`) and 12 (`+math.inf`: no progress is
    ever recorded), _check 21 (`sent = None`), 23 (`>=`: a stall read as progress), 25 (`now + sent_at`: cut at
    the first quiet check), 26 (`>`: one check later, past 1.5 x)."""
    dog, client, upstream = make(clock, 100.0, 1.0, lambda t: int(100 * t) + 50, lambda t: int(100 * min(t, stops)))
    clock.run(until=stops + 0.999)
    assert client.aborted_at is None
    clock.run(until=60.0)
    assert client.aborted_at is not None and stops + 1.0 <= client.aborted_at <= stops + 1.5
    assert clock.armed() == 0  # a cut connection is not watched any more
    assert upstream.failed_at == []


def test_a_client_that_keeps_reading_slowly_is_never_cut(clock):
    """Bytes always wait, but the client takes some between every two checks: no stall. mutmut: _check 21
    (`sent = None`), 25 (`now + sent_at`)."""
    dog, client, _ = make(clock, 100.0, 1.0, lambda t: 10_000, lambda t: int(30 * t))
    clock.run(until=60.0)
    assert client.aborted_at is None


def test_bytes_the_router_adds_are_not_progress(clock):
    """The backend keeps producing and the router keeps queueing while the client takes nothing: a stall,
    though the queue grows. mutmut: _check 22 (`output_size + pending` changes with every write)."""
    dog, client, _ = make(clock, 100.0, 1.0, lambda t: int(100 * t) + 50, lambda t: 0)
    clock.run(until=60.0)
    assert client.aborted_at is not None and client.aborted_at <= 1.5


def test_a_transport_someone_else_is_closing_is_left_to_them(clock):
    """The client stopped reading at once and aiohttp starts closing the connection at 0.3 s with bytes still
    queued: the watchdog neither aborts it (that would drop what close() still flushes) nor counts its frozen
    buffer as a stall, and the idle deadline still runs. mutmut: _check 18 (the closing-transport ternary forced
    open, `or True`) and 20 (its `else 1`)."""
    dog, client, upstream = make(clock, 5.0, 1.0, lambda t: 500, lambda t: 100)
    client.closed_at = 0.3
    clock.run(until=60.0)
    assert client.aborted_at is None
    assert upstream.failed_at == [5.0]


def test_stop_cancels_the_check_and_is_safe_twice(clock):
    """mutmut: stop 2 (`_handle = ""`: a second stop calls "".cancel())."""
    dog, client, upstream = make(clock, 1.0, 1.0, lambda t: 500, lambda t: 0)
    dog.stop()
    dog.stop()
    clock.run(until=60.0)
    assert client.aborted_at is None and upstream.failed_at == [] and clock.armed() == 0


# ---------------------------------------------------------------- the first-byte deadline (a real loop)

class Expired(Exception):
    pass


def expired_error():
    return Expired("first byte")


async def test_first_byte_deadline_turns_its_own_cancellation_into_the_error():
    """The block is still waiting when the deadline runs out: its await is cancelled and the block raises
    expired()'s error, with the task's cancellation taken back. mutmut: FirstByteDeadline._fire 1
    (`if self._task.done()`), 2 (`_handle = ""`), __exit__ 1 (`is None`), 4 (`<`: the deadline's own
    cancellation passes as a CancelledError)."""
    task = asyncio.current_task()
    with pytest.raises(Expired):
        with watchdog.FirstByteDeadline(0.01, expired_error):
            await asyncio.sleep(30)
    assert task.cancelling() == 0


async def test_first_byte_deadline_left_in_time_leaves_nothing_armed():
    """A block that ends before the deadline disarms it: nothing cancels the task afterwards. mutmut:
    FirstByteDeadline.__init__ 6 (`_handle = None`: the timer is armed but never cancelled, and cuts whatever the
    task does next)."""
    with watchdog.FirstByteDeadline(0.01, expired_error):
        await asyncio.sleep(0)
    await asyncio.sleep(0.1)  # past the deadline: its timer, had it stayed armed, was due first
    assert asyncio.current_task().cancelling() == 0


async def test_a_cancellation_from_elsewhere_passes_through_the_first_byte_deadline():
    """A client leaving (another cancel of the task) before the deadline, or after it fired but before the block
    ended, stays a CancelledError: the deadline takes back only its own. mutmut: __exit__ 2 (`or`: the
    deadline's error replaces a client's cancellation that came after it fired), 3 (`is not asyncio.CancelledError`)."""
    async def waiting(deadline: float, leaves_after_the_deadline: bool):
        with watchdog.FirstByteDeadline(deadline, expired_error):
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                if leaves_after_the_deadline:
                    asyncio.current_task().cancel()
                raise

    for deadline, after in ((30.0, False), (0.01, True)):
        task = asyncio.create_task(waiting(deadline, after))
        await asyncio.sleep(0)
        if not after:
            task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
