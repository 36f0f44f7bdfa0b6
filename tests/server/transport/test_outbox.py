"""A ModelStreamInfer call's outbox: bounded by bytes, one message beyond."""

from __future__ import annotations

import asyncio

from dlserve.server.transport.grpc.outbox import Outbox


def test_put_waits_while_the_limit_is_reached() -> None:
    async def scenario() -> None:
        box = Outbox(limit=10)
        await box.put(b"x" * 6)
        await box.put(b"y" * 6)  # 6 < 10: in, now 12 bytes wait
        third = asyncio.ensure_future(box.put(b"z" * 6))
        await asyncio.sleep(0)  # let it run to its wait
        assert not third.done()
        box.put_nowait(None)  # notices never wait
        assert await box.get() == b"x" * 6  # 6 bytes left: room again
        await asyncio.wait_for(third, 5)
        assert [await box.get() for _ in range(3)] == [b"y" * 6, None, b"z" * 6]

    asyncio.run(scenario())


def test_get_waits_for_a_message() -> None:
    async def scenario() -> None:
        box = Outbox()
        getter = asyncio.ensure_future(box.get())
        await asyncio.sleep(0)
        assert not getter.done()
        await box.put(b"m")
        assert await asyncio.wait_for(getter, 5) == b"m"

    asyncio.run(scenario())


def test_admit_lets_fewer_producers_start_as_messages_grow() -> None:
    async def scenario() -> None:
        box = Outbox(limit=100)
        assert not box.crowded(15) and box.crowded(16)  # a guess: 16 may start at first
        box.put_nowait(b"x" * 10)
        assert not box.crowded(8) and box.crowded(9)  # 10 queued, 10 each: 9 may run
        assert await box.get() == b"x" * 10
        running = [3]
        box.put_nowait(b"y" * 40)  # 40 queued, 40 each: none more while 3 run
        admitted = asyncio.ensure_future(box.admit(lambda: running[0]))
        await asyncio.sleep(0)
        assert not admitted.done()
        running[0] = 1
        box.finished()  # still 40 + 2 * 40 > 100
        await asyncio.sleep(0)
        assert not admitted.done()
        assert await box.get() == b"y" * 40  # 0 + 2 * 40 fits
        await asyncio.wait_for(admitted, 5)

    asyncio.run(scenario())
