"""Stopping the router's background loops (health probes, load polls)."""
from __future__ import annotations

import asyncio
import contextlib


async def cancel(task: asyncio.Task | None) -> None:
    """Cancel a background loop and wait until it has really stopped."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
