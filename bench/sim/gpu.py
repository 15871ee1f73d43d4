"""The simulated GPUs that co-located engines time-share: one step at a time on one clock."""
from __future__ import annotations

import asyncio

# Assumed cost (simulated ms) of the GPU switching from one server's context to the other's when both
# are busy. Not measured: without MPS the driver time-slices between CUDA contexts; the figure only
# has to be small next to a decode step (10-350 ms here). Change it with --switch-ms.
DEFAULT_SWITCH_MS = 0.5


class Gpu:
    """A set of GPUs shared by several engines (co-location): their steps never overlap.

    Each engine asks for its next step with `reserve(engine, start, step_ms, speedup)`; the step begins
    when both the engine is ready (`start`) and the GPUs are free (the other engine's reserved step has
    ended), so while both are busy their steps alternate and each waits for the other's. An engine whose
    peer is idle finds the GPUs free and runs exactly as it would alone. Everything runs on one event
    loop, so reservations are taken in a well-defined order without locks. When the loop runs late, an
    engine first lets a busy peer whose previous step ended earlier take its turn (`wait_turn`), so the
    order of steps follows the simulated schedule, not which task the event loop happened to run first.
    """

    def __init__(self, switch_ms: float = DEFAULT_SWITCH_MS) -> None:
        if switch_ms < 0:
            raise ValueError("switch_ms must be >= 0")
        self.switch_ms = switch_ms
        self.busy_until = 0.0  # wall (monotonic) time at which the last reserved step ends
        self.last_user: object | None = None
        self.members: list = []  # the servers sharing these GPUs (a speedup change applies to all)
        self.engines: list = []  # their engines (each registers itself)
        self.ready_at: dict[int, float] = {}  # id(engine) -> end of its last reserved step
        self.switches = 0
        self._waiters: list[asyncio.Future] = []

    def _blocker(self, engine: object, start: float) -> object | None:
        """A busy peer that became ready for its next step before `engine` did and has not reserved it yet."""
        for other in self.engines:
            if other is not engine and other.has_work and self.ready_at.get(id(other), float("-inf")) < start:
                return other
        return None

    def ready(self, engine: object, start: float) -> None:
        """The engine (back from idle) wants its next step at `start`."""
        self.ready_at[id(engine)] = start
        self._wake_waiters()

    async def wait_turn(self, engine: object, start: float) -> None:
        """Wait while a busy peer that became ready earlier has not reserved its next step (a late loop).

        Each engine is ready at the end of its last step (or when it woke from idle), so the engine that was
        ready first reserves first; the strict order of ready times rules out two engines waiting for each
        other."""
        while self._blocker(engine, start) is not None:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)

    def _wake_waiters(self) -> None:
        waiters, self._waiters = self._waiters, []
        for w in waiters:
            if not w.done():
                w.set_result(None)

    def reserve(self, engine: object, start: float, step_ms: float, speedup: float) -> tuple[float, float]:
        """(begin, end) wall times of the engine's next step of `step_ms` simulated milliseconds."""
        begin = start
        if self.busy_until > start:
            begin = self.busy_until  # the GPUs are running the other engine's step: wait for its end
        if self.last_user is not None and self.last_user is not engine and self.busy_until >= start:
            # the GPUs were busy with the other server up to now: a context switch before this step
            step_ms += self.switch_ms
            self.switches += 1
        end = begin + step_ms / 1000.0 / speedup
        self.busy_until = end
        self.last_user = engine
        self.ready_at[id(engine)] = end
        self._wake_waiters()
        return begin, end

    def idle(self, engine: object) -> None:
        """The engine ran out of work: a peer waiting for its turn need not wait for it any more."""
        self._wake_waiters()
