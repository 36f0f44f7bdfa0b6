"""A model version's open streams: unloading waits for them, then ends the rest."""

from __future__ import annotations

import asyncio
import time

from dlserve import errors
from dlserve.server.core.streaming import OpenStreams


def test_drain_returns_when_the_last_stream_ends() -> None:
    async def scenario() -> None:
        streams = OpenStreams()
        cut: list[errors.DlserveError] = []
        streams.open(1, cut.append)
        streams.open(2, cut.append)
        drained = asyncio.ensure_future(streams.drain(time.monotonic() + 30, "m"))
        await asyncio.sleep(0)
        streams.close(1)
        await asyncio.sleep(0)
        assert not drained.done()  # one is still open
        streams.close(2)
        await asyncio.wait_for(drained, 5)
        assert cut == []

    asyncio.run(scenario())


def test_streams_open_at_the_deadline_are_cut() -> None:
    async def scenario() -> None:
        streams = OpenStreams()
        cut: list[errors.DlserveError] = []
        streams.open(1, cut.append)
        await streams.drain(time.monotonic(), "flood")  # the deadline has passed
        assert len(cut) == 1 and isinstance(cut[0], errors.UnavailableError)
        assert cut[0].message == "model 'flood' is being unloaded"

    asyncio.run(scenario())
