"""Requests over a stream (gRPC ModelStreamInfer, BLS into a decoupled model): one item per
response. A decoupled model answers any number of times, through its worker's
``infer_stream``; any other model once, through ``InferenceService.infer``.

Also the types a BLS request brings through the core (:class:`Call`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from dlserve import errors
from dlserve.core.regions import RegionLease
from dlserve.types import InferRequest, InferResponse, OutputTensor
from dlserve.workers.client import WorkerReply, WorkItem
from dlserve.workers.placement import NO_SPANS

if TYPE_CHECKING:
    from dlserve.core.manager import ModelVersion
    from dlserve.core.service import InferenceService


@dataclass(frozen=True, slots=True)
class Call:
    """What a BLS request brings besides the request: the models upstream of it (a cycle
    is refused) and where its inputs are when they travel by reference (client regions,
    the caller's arenas)."""

    chain: tuple[str, ...] = ()
    lease: RegionLease | None = None
    lend: bool = False  # outputs stay in the callee's memory for the caller to map


NO_CALL: Final = Call()


@dataclass(frozen=True, slots=True)
class StreamItem:
    """One response of a streamed request, or its failure; ``final`` ends the request."""

    response: InferResponse | None  # None with no error: a bare final flag
    error: errors.DlserveError | None
    final: bool
    model_version: str = ""


async def infer_stream(
    service: InferenceService, request: InferRequest, call: Call = NO_CALL
) -> AsyncGenerator[StreamItem, None]:
    """Run a request over a stream: one item per response, the last one final. A model
    that answers once gives one item; a decoupled model any number. Failures are items
    (the stream goes on); leaving early marks the request cancelled in the model."""
    try:
        loaded = service.version(request.model_name, request.model_version)
        if not loaded.decoupled:
            yield StreamItem(await service.infer(request, call), None, True)
            return
    except errors.DlserveError as exc:
        yield StreamItem(None, exc, True)
        return
    async with contextlib.aclosing(_run_decoupled(service, loaded, request, call)) as items:
        async for item in items:
            yield item


async def _run_decoupled(
    service: InferenceService, loaded: ModelVersion, request: InferRequest, call: Call
) -> AsyncGenerator[StreamItem, None]:
    """A decoupled model's request goes to its least busy instance directly (not through
    the scheduler's queue: no batching or priorities for decoupled models yet)."""
    received = time.monotonic_ns()
    lease = call.lease if call.lease is not None else service.regions.lease(request)
    try:
        inputs, _ = loaded.validator.check(request)
        assert loaded.pool is not None
        worker = loaded.pool.pick_on(None if lease is None else lease.device)
        if lease is not None:
            lease.bind(worker)
        item = WorkItem(request.id, inputs, [o.name for o in request.outputs],
                        request.parameters, lease.inputs if lease else NO_SPANS,
                        lease.outputs if lease else NO_SPANS, list(call.chain),
                        call.lend)  # fmt: skip
        responses = worker.infer_stream(item)
        async with contextlib.aclosing(responses):
            async for each in responses:
                if each.final and each.timings is not None:
                    service._record(loaded, WorkerReply([], each.timings), 1, received)
                response = None
                if each.reply is not None:
                    response = InferResponse(
                        request.model_name, str(loaded.version), request.id,
                        reply_outputs(loaded, each.reply), dict(each.reply.parameters),
                    )  # fmt: skip
                yield StreamItem(response, each.error, each.final, str(loaded.version))
    except errors.DlserveError as exc:
        reason = "REJECTED" if isinstance(exc, errors.InvalidArgumentError) else "BACKEND"
        loaded.stats.record_failure(time.monotonic_ns() - received, reason)
        yield StreamItem(None, exc, True)
    finally:
        if lease is not None:
            service.regions.release(lease)


def reply_outputs(loaded: ModelVersion, reply: WorkerReply) -> list[OutputTensor]:
    """A reply's outputs with the shapes the client sees; lent ones stay lent (BLS)."""
    shape = loaded.validator.output_shape
    return [
        OutputTensor(o.name, o.datatype, shape(o.name, o.shape), o.data, lent=o.lent)
        for o in reply.outputs
    ]
