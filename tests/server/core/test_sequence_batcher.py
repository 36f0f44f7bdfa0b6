"""The sequence batcher, driven through the service in one process: sequences keep their
slot (and so their instance's state), a sequence that finds every slot taken waits in the
backlog for one, a cancelled backlogged request ends its sequence, and an idle sequence
loses its slot.

tests/models/sequence_acc keeps ONE running sum per instance, reset by the START control:
a sequence gets its own sum only if every request of it reaches the instance its START
went to. It has two instances with one slot each.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from dlserve import errors
from dlserve.server.core.service import InferenceService
from dlserve.types import InferRequest

from .harness import Core, failures, in_flight, output, pending, request, tensor, until

NO_START = "must specify the START flag on the first request of the sequence"


def step(
    corrid: int, value: int, *, start: bool = False, end: bool = False, model: str = "sequence_acc"
) -> InferRequest:
    """One request of sequence ``corrid``, as a client sends it (Triton's parameters)."""
    return request(
        model, tensor("INPUT", np.array([value], np.int32)),
        sequence_id=corrid, sequence_start=start, sequence_end=end,
    )  # fmt: skip


async def total(service: InferenceService, call: InferRequest | asyncio.Task[Any]) -> int:
    """The running sum the model answered (of a request, or of a request in flight)."""
    response = await call if isinstance(call, asyncio.Task) else await service.infer(call)
    return int(output(response, "SUM")[0])


async def test_interleaved_sequences_keep_their_own_sum(core: Core) -> None:
    async with core.serving("sequence_acc") as service:
        assert await total(service, step(1, 1, start=True)) == 1
        assert await total(service, step(2, 10, start=True)) == 10
        assert await total(service, step(1, 2)) == 3
        assert await total(service, step(2, 20)) == 30
        assert await total(service, step(1, 3, end=True)) == 6
        assert await total(service, step(2, 30, end=True)) == 60
        with pytest.raises(errors.InvalidArgumentError, match=NO_START):
            await service.infer(step(1, 4))  # ended: it takes no more requests


async def test_a_sequence_with_every_slot_taken_waits_in_the_backlog(core: Core) -> None:
    """Two sequences hold both slots; a third waits (pending) while they go on, and takes
    the slot the first one's END frees."""
    async with core.serving("sequence_acc") as service:
        assert await total(service, step(1, 1, start=True)) == 1
        assert await total(service, step(2, 10, start=True)) == 10
        third = in_flight(service.infer(step(3, 100, start=True)))
        await until(lambda: pending(service, "sequence_acc") == 1, "the third sequence waits")
        assert await total(service, step(2, 20)) == 30  # the bound ones go on
        assert not third.done()
        assert await total(service, step(1, 2, end=True)) == 3
        assert await total(service, third) == 100  # on the freed slot, its sum reset
        assert await total(service, step(3, 200)) == 300
        assert await total(service, step(2, 30)) == 60
        assert pending(service, "sequence_acc") == 0


async def test_a_cancelled_request_in_the_backlog_ends_its_sequence(core: Core) -> None:
    async with core.serving("sequence_acc") as service:
        await total(service, step(1, 1, start=True))
        await total(service, step(2, 10, start=True))
        third = in_flight(service.infer(step(3, 100, start=True)))
        await until(lambda: pending(service, "sequence_acc") == 1, "the third sequence waits")
        third.cancel()
        with pytest.raises(asyncio.CancelledError):
            await third
        assert pending(service, "sequence_acc") == 0
        assert failures(service, "sequence_acc", "CANCELED") == 1
        with pytest.raises(errors.InvalidArgumentError, match=NO_START):
            await service.infer(step(3, 200))
        assert await total(service, step(1, 2, end=True)) == 3  # nothing of 3 ran before it
        assert await total(service, step(3, 300, start=True)) == 300


async def test_an_idle_sequence_loses_its_slot_to_a_waiting_one(core: Core) -> None:
    """One slot, and a sequence idle for max_sequence_idle_microseconds (here 0.2 s) loses
    it: the sequence waiting for a slot runs without the first one ending, and the first
    one's next request needs a new START."""
    config = core.config("sequence_acc_idle")
    text = config.read_text()
    assert "max_sequence_idle_microseconds: 1\n" in text
    config.write_text(text.replace("idle_microseconds: 1\n", "idle_microseconds: 200000\n"))
    async with core.serving("sequence_acc_idle") as service:
        idle = "sequence_acc_idle"
        assert await total(service, step(1, 1, start=True, model=idle)) == 1
        assert await total(service, step(2, 10, start=True, model=idle)) == 10
        with pytest.raises(errors.InvalidArgumentError, match=NO_START):
            await service.infer(step(1, 2, model=idle))
