"""Runs what the policy's observe() left to learn() (big model refits) a step at a time between the router's other work."""
from __future__ import annotations

import asyncio
import logging

from router.pools import Pools
from router.tasks import cancel
from router.tuning import DEFAULT

log = logging.getLogger("router.learner")

# Samples one step of learning goes over: one step of a speed model's refit (~0.1-0.5 ms).
LEARN_STEP = DEFAULT.fit_step


class Learner:
    """Woken by each finished exchange (Pools.report_done); then calls policy.learn(LEARN_STEP), yielding to the event
    loop between calls, until nothing is left."""

    def __init__(self, pools: Pools) -> None:
        self.pools = pools
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def wake(self) -> None:
        self._wake.set()

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                while True:
                    if not self.pools.policy.learn(LEARN_STEP):
                        break
                    await asyncio.sleep(0)  # the streams and requests waiting go first
            except Exception:
                # A bug in one refit must not end learning for the life of the process.
                log.exception("policy learning step failed; learning continues")

    def start(self) -> None:
        self.pools.learner = self.wake
        self._task = asyncio.create_task(self._loop(), name="router-learner")

    async def stop(self) -> None:
        await cancel(self._task)
        self._task = None
        self.pools.learner = None
