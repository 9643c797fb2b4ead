"""LineSlots: batch lines fill an idle app and give way to other requests."""

from __future__ import annotations

import asyncio

from hyperserve.common import line_slots


def test_batch_lines_yield_to_other_requests_and_come_back_after_a_quiet_while(monkeypatch):
    """Idle: 3 lines at once. While another request runs, and for QUIET_S after it ends, one at a
    time (the busy limit); after that, 3 at once again."""
    monkeypatch.setattr(line_slots, "QUIET_S", 0.3)

    async def scenario() -> list[list[int]]:
        slots = line_slots.LineSlots(idle=3, busy=1)

        async def lines() -> list[int]:
            """Three lines of 20 ms started together: how many were in the app as each entered."""
            taken = []

            async def line() -> None:
                async with slots.line():
                    taken.append(slots.taken)
                    await asyncio.sleep(0.02)

            await asyncio.gather(*(line() for _ in range(3)))
            return taken

        async def other() -> None:
            async with slots.other():
                await asyncio.sleep(0.1)

        idle = await lines()
        chat = asyncio.create_task(other())
        await asyncio.sleep(0)
        during = await lines()
        await chat
        after = await lines()  # within the quiet while
        await asyncio.sleep(0.3)
        return [idle, during, after, await lines()]

    assert asyncio.run(scenario()) == [[1, 2, 3], [1, 1, 1], [1, 1, 1], [1, 2, 3]]
