"""The server loop's polling (``server/core/instances/polling.py``), on a real event loop:
it polls for ``--reply-poll-us`` after the last request went to a worker, whether or not
the reply is in by then (a client's next request is read without waking the loop), with
``--busy-poll-us`` also as long as a request is in flight, and not at all with both off."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from dlserve.server.core.instances import polling
from dlserve.server.core.instances.polling import spinner


@pytest.fixture(autouse=True)
def _defaults_after() -> Iterator[None]:
    yield
    polling.set_busy_poll(0)


async def _turns_while_running() -> int:
    """Turns of the loop until the spinner stops."""
    turns = 0
    while spinner.running:
        await asyncio.sleep(0)
        turns += 1
    return turns


def test_the_loop_polls_for_the_whole_time_after_the_last_request_even_once_answered() -> None:
    polling.set_busy_poll(0, reply_poll_us=20_000)

    async def main() -> tuple[int, float]:
        start = time.monotonic()
        spinner.hold([])  # a request went out, and its worker has nothing in flight now
        assert spinner.running
        turns = await _turns_while_running()
        return turns, time.monotonic() - start

    turns, took = asyncio.run(main())
    assert took >= 0.020
    assert turns > 1
    assert not spinner.running


def test_a_later_request_extends_the_polling() -> None:
    polling.set_busy_poll(0, reply_poll_us=20_000)

    async def main() -> float:
        start = time.monotonic()
        spinner.hold([])
        while time.monotonic() - start < 0.015:
            await asyncio.sleep(0)
        spinner.hold([])  # 15 ms later: 20 ms more from here
        await _turns_while_running()
        return time.monotonic() - start

    assert asyncio.run(main()) >= 0.035


def test_busy_polling_lasts_while_a_request_is_in_flight() -> None:
    polling.set_busy_poll(300, reply_poll_us=0)

    async def main() -> None:
        pending = {7: "in flight"}
        spinner.hold(pending)
        for _ in range(100):
            await asyncio.sleep(0)
            assert spinner.running
        pending.clear()  # the reply is in
        assert await _turns_while_running() <= 2

    asyncio.run(main())


def test_with_both_off_the_loop_never_polls() -> None:
    polling.set_busy_poll(0, reply_poll_us=0)

    async def main() -> None:
        spinner.hold({7: "in flight"})
        assert not spinner.running

    asyncio.run(main())


def test_a_loop_that_ended_while_polling_leaves_nothing_to_the_next() -> None:
    """A server whose loop ended while it polled (its last request answered less than
    ``--reply-poll-us`` before) and another server on a new loop in the same process: the
    new loop polls for its own requests, and stops."""
    polling.set_busy_poll(0, reply_poll_us=20_000)

    async def ends_while_polling() -> None:
        spinner.hold([])

    async def next_server() -> int:
        spinner.hold([])
        turns = 0
        while spinner.running and turns < 1_000_000:
            await asyncio.sleep(0)
            turns += 1
        return turns

    asyncio.run(ends_while_polling())
    assert spinner.running  # left so by the loop that ended
    turns = asyncio.run(next_server())
    assert 1 < turns < 1_000_000
    assert not spinner.running
