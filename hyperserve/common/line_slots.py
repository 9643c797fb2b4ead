"""How many Batch API lines may be in the app at once, so that batches fill an idle engine and
give it back to interactive requests within a line's time."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time

QUIET_S = 5.0  # after the last other request, how long batch lines stay at the busy limit


class LineSlots:
    """How many batch lines may be in the app at once: `idle` while no other request is, `busy`
    while one is and for QUIET_S after the last ends. Interactive traffic so gets the engine back
    within a line's time, and batches fill it when nobody else uses it."""

    def __init__(self, idle: int, busy: int) -> None:
        self.idle, self.busy = idle, busy
        self.taken = 0
        self.others = 0  # requests in the app now that are not batch lines
        self.last_other = -math.inf  # when the last of them ended (time.monotonic)
        self._changed = asyncio.Condition()

    def _quiet_in(self) -> float | None:
        """Seconds until the idle limit applies (0: it does now; None: not while others run)."""
        if self.others:
            return None
        return max(QUIET_S - (time.monotonic() - self.last_other), 0.0)

    def limit(self) -> int:
        return self.idle if self._quiet_in() == 0 else self.busy

    @contextlib.asynccontextmanager
    async def line(self):
        """Around one batch line in the app."""
        async with self._changed:
            while self.taken >= self.limit():
                try:
                    await asyncio.wait_for(self._changed.wait(), timeout=self._quiet_in() or None)
                except TimeoutError:
                    pass
            self.taken += 1
        try:
            yield
        finally:
            async with self._changed:
                self.taken -= 1
                self._changed.notify_all()

    @contextlib.asynccontextmanager
    async def other(self):
        """Around any other request in the app."""
        self.others += 1
        try:
            yield
        finally:
            self.others -= 1
            self.last_other = time.monotonic()
            async with self._changed:
                self._changed.notify_all()  # the waiters time their wait for the quiet period
