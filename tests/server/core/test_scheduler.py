"""The scheduler, driven through the service in one process: a request waiting at a busy
instance, an instance that dies with a request waiting at it, cancellation of waiting
requests, dynamic batching, priorities and queue policies.

The models (tests/models/serial, batched, batched_limits, gated) report which execute call
served a request (EXECUTION, from 1), how many requests it got (BATCH) and the request's
place in it (POSITION); a request with a gate's parameters is held inside execute until the
test opens the gate.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from typing import Any

import numpy as np
import pytest

from dlserve import errors
from dlserve.server.core.service import InferenceService
from dlserve.server.core.streaming import StreamItem
from dlserve.types import InferRequest, ParamValue

from .harness import (
    Core,
    Gate,
    failures,
    in_flight,
    output,
    pending,
    request,
    scalars,
    tensor,
    until,
)

REPORTED = ("BATCH", "EXECUTION", "POSITION")


def counted(model: str, value: float, batch: int = 0, /, **parameters: ParamValue) -> InferRequest:
    """A request of one of the models that report how they were executed (``batch`` > 0:
    a batching model's request of that many rows)."""
    shape = (batch, 1) if batch else (1,)
    return request(model, tensor("INPUT0", np.full(shape, value, np.float32)), **parameters)


async def report(
    service: InferenceService, call: InferRequest | asyncio.Task[Any], value: float
) -> dict[str, int]:
    """What the model reported of a request in flight (a task) or about to be sent."""
    response = await call if isinstance(call, asyncio.Task) else await service.infer(call)
    np.testing.assert_array_equal(output(response, "OUTPUT0").flat, value * 2)
    return scalars(response, REPORTED)


def held(service: InferenceService, gate: Gate, model: str, batch: int = 0) -> asyncio.Task[Any]:
    return in_flight(service.infer(counted(model, 0.5, batch, **gate.parameters)))


# -- without dynamic batching: one request may wait at the busy instance -----------------------
async def test_a_request_waits_at_the_busy_instance_and_starts_without_the_server(
    core: Core,
) -> None:
    """serial has one instance and no batcher: the request behind a running one is sent to
    the instance at once, to wait in its worker's socket. With the event loop stopped (the
    test blocks it), the worker still starts it when the running one returns."""
    async with core.serving("serial") as service:
        first, second = core.gate(), core.gate()
        running = held(service, first, "serial")
        await first.started()
        behind = in_flight(service.infer(counted("serial", 1.0, **second.parameters)))
        await until(lambda: pending(service, "serial") == 1, "the second request pending")
        first.open_now()  # blocking: the event loop does nothing until the second has started
        second.wait_started()
        await second.open()
        assert (await report(service, running, 0.5))["EXECUTION"] == 1
        assert (await report(service, behind, 1.0))["EXECUTION"] == 2
        assert pending(service, "serial") == 0


async def test_only_one_request_waits_at_the_instance_the_others_in_the_queue(core: Core) -> None:
    """Requests beyond the one waiting at the instance wait in the server and run in the
    order they came, one execute each."""
    async with core.serving("serial") as service:
        gate = core.gate()
        running = held(service, gate, "serial")
        await gate.started()
        waiting = [in_flight(service.infer(counted("serial", float(i)))) for i in range(3)]
        await until(lambda: pending(service, "serial") == 3, "three requests pending")
        await gate.open()
        assert (await report(service, running, 0.5))["EXECUTION"] == 1
        reports = [await report(service, task, float(i)) for i, task in enumerate(waiting)]
        assert [r["EXECUTION"] for r in reports] == [2, 3, 4]
        assert {r["BATCH"] for r in reports} == {1}
        (stats,) = service.statistics("serial")
        assert (stats.inference_count, stats.execution_count) == (4, 4)


async def test_cancelled_requests_leave_unexecuted_from_the_queue_and_from_the_instance(
    core: Core,
) -> None:
    """One request waits at the busy instance, one in the queue: both are cancelled (their
    clients went away). Neither runs, each counts as a CANCELED failure, and the next
    request is the instance's second execute."""
    async with core.serving("serial") as service:
        gate = core.gate()
        running = held(service, gate, "serial")
        await gate.started()
        at_instance = in_flight(service.infer(counted("serial", 1.0)))
        in_queue = in_flight(service.infer(counted("serial", 2.0)))
        await until(lambda: pending(service, "serial") == 2, "two requests pending")
        for task, left in ((in_queue, 1), (at_instance, 0)):
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert pending(service, "serial") == left
        await gate.open()
        assert (await report(service, running, 0.5))["EXECUTION"] == 1
        assert (await report(service, counted("serial", 3.0), 3.0))["EXECUTION"] == 2
        assert failures(service, "serial", "CANCELED") == 2
        (stats,) = service.statistics("serial")
        assert (stats.inference_count, stats.execution_count) == (2, 2)


# -- an instance that dies ----------------------------------------------------------------------
def gated(gate: Gate, value: float) -> InferRequest:
    """A request of gated (held until its gate opens; DATA -1 makes the instance exit)."""
    control = np.array([gate.parameters["started"], gate.parameters["go"]], dtype=np.object_)
    data = tensor("DATA", np.array([value], np.float32))
    return request("gated", tensor("CONTROL", control, "BYTES"), data)


async def test_a_request_waiting_at_an_instance_that_dies_goes_back_to_the_queue(
    core: Core,
) -> None:
    """The running request ends its instance's process (os._exit): it fails as Triton says
    of a dead stub. The one waiting behind it had not started, so it goes back to the
    queue, where it fails as queued requests do while the model's only instance restarts
    (UNAVAILABLE), as does a request sent meanwhile. The restarted instance serves on."""
    async with core.serving("gated", in_process=False) as service:
        crasher, waiter = core.gate(), core.gate()
        crashing = in_flight(service.infer(gated(crasher, -1.0)))
        await crasher.started()
        behind = in_flight(service.infer(gated(waiter, 2.0)))
        await until(lambda: pending(service, "gated") == 1, "the second request pending")
        await crasher.open()
        with pytest.raises(errors.WorkerDiedError, match="Stub process 'gated_0_0' is not healthy"):
            await crashing
        with pytest.raises(errors.UnavailableError, match=r"is available \(restarting\)"):
            await behind
        assert not waiter.is_started
        with pytest.raises(errors.UnavailableError, match="'gated' has no available versions"):
            await service.infer(gated(waiter, 3.0))
        assert pending(service, "gated") == 0
        await until(lambda: service.model_ready("gated"), "the instance restarted")
        after = core.gate()
        answer = in_flight(service.infer(gated(after, 4.0)))
        await after.started()
        await after.open()
        np.testing.assert_array_equal(output(await answer, "OUTPUT0"), [8.0])


# -- dynamic batching -----------------------------------------------------------------------------
async def test_requests_that_wait_together_run_in_one_execute(core: Core) -> None:
    async with core.serving("batched") as service:
        gate = core.gate()
        running = held(service, gate, "batched", batch=1)
        await gate.started()
        waiting = [in_flight(service.infer(counted("batched", float(i), 1))) for i in range(3)]
        await until(lambda: pending(service, "batched") == 3, "three requests queued")
        await gate.open()
        assert await report(service, running, 0.5) == {"BATCH": 1, "EXECUTION": 1, "POSITION": 0}
        reports = [await report(service, task, float(i)) for i, task in enumerate(waiting)]
        assert reports == [{"BATCH": 3, "EXECUTION": 2, "POSITION": i} for i in range(3)]
        (stats,) = service.statistics("batched")
        assert (stats.inference_count, stats.execution_count) == (4, 2)
        assert {b.batch_size: b.compute_infer.count for b in stats.batch_stats} == {1: 1, 3: 1}


# -- priorities and queue policies (batched_limits: levels 1 and 2, see its config) ---------------
async def test_a_higher_priority_request_runs_before_an_earlier_one(core: Core) -> None:
    """Each request fills a batch (8 rows), so each runs in an execute of its own."""
    async with core.serving("batched_limits") as service:
        gate = core.gate()
        running = held(service, gate, "batched_limits", batch=8)
        await gate.started()
        low = in_flight(service.infer(counted("batched_limits", 1.0, 8)))
        high = in_flight(service.infer(counted("batched_limits", 2.0, 8, priority=1)))
        await until(lambda: pending(service, "batched_limits") == 2, "two requests queued")
        await gate.open()
        await running
        assert (await report(service, high, 2.0))["EXECUTION"] == 2
        assert (await report(service, low, 1.0))["EXECUTION"] == 3


async def test_a_full_level_refuses_at_once_and_other_levels_take_requests(core: Core) -> None:
    async with core.serving("batched_limits") as service:
        gate = core.gate()
        running = held(service, gate, "batched_limits", batch=8)
        await gate.started()
        queued = [in_flight(service.infer(counted("batched_limits", 1.0, 8))) for _ in range(2)]
        await until(lambda: pending(service, "batched_limits") == 2, "level 2 full")
        with pytest.raises(errors.UnavailableError, match=r"^Exceeds maximum queue size$"):
            await service.infer(counted("batched_limits", 1.0, 8))
        other = in_flight(service.infer(counted("batched_limits", 3.0, 8, priority=1)))
        await until(lambda: pending(service, "batched_limits") == 3, "level 1 takes one")
        await gate.open()
        await running
        for task, value in ((other, 3.0), (queued[0], 1.0), (queued[1], 1.0)):
            assert (await report(service, task, value))["BATCH"] == 1


async def test_a_request_past_its_timeout_is_rejected_while_it_waits(core: Core) -> None:
    """Level 2 rejects a request whose own timeout (1 ms) expires in the queue: it fails
    while the instance is still busy, and never runs."""
    async with core.serving("batched_limits") as service:
        gate = core.gate()
        running = held(service, gate, "batched_limits", batch=8)
        await gate.started()
        with pytest.raises(errors.UnavailableError, match=r"^Request timeout expired$"):
            await service.infer(counted("batched_limits", 1.0, 8, timeout=1000))
        await gate.open()
        await running
        (stats,) = service.statistics("batched_limits")
        assert (stats.inference_count, stats.execution_count) == (8, 1)


async def test_a_delayed_request_runs_after_its_level_s_others(core: Core) -> None:
    """Level 1 delays a request whose timeout expired: it goes behind the level's requests
    that are on time, though it came first."""
    async with core.serving("batched_limits") as service:
        gate = core.gate()
        running = held(service, gate, "batched_limits", batch=8)
        await gate.started()
        late = in_flight(service.infer(counted("batched_limits", 1.0, 8, priority=1, timeout=1)))
        on_time = in_flight(service.infer(counted("batched_limits", 2.0, 8, priority=1)))
        await until(lambda: pending(service, "batched_limits") == 2, "two requests queued")
        await gate.open()
        await running
        assert (await report(service, on_time, 2.0))["EXECUTION"] == 2
        assert (await report(service, late, 1.0))["EXECUTION"] == 3


# -- a decoupled model's requests (gated_stream: one instance, a queue of one) -------------------
async def streamed(stream: AsyncGenerator[StreamItem, None]) -> list[StreamItem]:
    """Every item of a stream, up to its final one."""
    items = []
    async with contextlib.aclosing(stream):
        async for item in stream:
            items.append(item)
            if item.final:
                break
    return items


def gated_stream(gate: Gate) -> InferRequest:
    control = np.array([gate.parameters["started"], gate.parameters["go"]], dtype=np.object_)
    return request("gated_stream", tensor("CONTROL", control, "BYTES"))


async def test_a_stream_left_while_its_request_is_queued_never_runs(core: Core) -> None:
    """A decoupled model's requests queue as others do (its queue holds one: the next is
    refused at once); one whose consumer leaves while queued leaves the queue unexecuted.
    Each response says how many requests the model had executed before."""
    async with core.serving("gated_stream") as service:
        first, second = core.gate(), core.gate()
        running = in_flight(streamed(service.infer_stream(gated_stream(first))))
        await first.started()
        queued = in_flight(streamed(service.infer_stream(gated_stream(second))))
        await until(lambda: pending(service, "gated_stream") == 1, "the second request queued")
        (refused,) = await streamed(service.infer_stream(gated_stream(core.gate())))
        assert isinstance(refused.error, errors.UnavailableError), refused
        assert refused.error.message == "Exceeds maximum queue size"
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        assert pending(service, "gated_stream") == 0
        await first.open()
        (answer,) = await running
        assert answer.final and answer.response is not None
        np.testing.assert_array_equal(output(answer.response, "OUTPUT0"), [0])
        after = core.gate()
        next_one = in_flight(streamed(service.infer_stream(gated_stream(after))))
        await after.started()
        await after.open()
        (answer,) = await next_one
        assert answer.response is not None
        np.testing.assert_array_equal(output(answer.response, "OUTPUT0"), [1])  # not 2
