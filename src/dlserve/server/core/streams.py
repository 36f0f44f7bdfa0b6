"""Requests over a stream (gRPC ModelStreamInfer, BLS into a decoupled model): one item per
response. A decoupled model answers any number of times (its requests go through its
scheduler, and its responses come as they are sent); any other model once, through
``InferenceService.infer``.

Also the types a BLS request brings through the core (:class:`Call`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from dlserve import errors
from dlserve.server.core import classification
from dlserve.server.core.instances.handle import WorkerHandle
from dlserve.server.core.instances.replies import WorkerReply
from dlserve.server.core.instances.streams import StreamReply, StreamSink
from dlserve.server.core.shm.registry import RegionLease
from dlserve.server.core.telemetry.stats import failure_reason
from dlserve.types import InferRequest, InferResponse, OutputTensor

if TYPE_CHECKING:
    from dlserve.server.core.models.manager import ModelVersion
    from dlserve.server.core.service import InferenceService
    from dlserve.server.core.telemetry.tracer import Trace


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
    service: InferenceService, request: InferRequest, call: Call = NO_CALL,
    trace: Trace | None = None,
) -> AsyncGenerator[StreamItem, None]:  # fmt: skip
    """Run a request over a stream: one item per response, the last one final. A model
    that answers once gives one item; a decoupled model any number. Failures are items
    (the stream goes on); leaving early marks the request cancelled in the model.
    ``trace``: the request's trace, when it is traced (the caller releases it)."""
    try:
        loaded = service.version(request.model_name, request.model_version)
        if not loaded.decoupled:
            yield StreamItem(await service.infer(request, call, trace), None, True)
            return
        classes = classification.requested(request) if request.outputs else {}
    except errors.DlserveError as exc:
        yield StreamItem(None, exc, True)
        return
    decoupled = _run_decoupled(service, loaded, request, call, trace)
    async with contextlib.aclosing(decoupled) as items:
        async for item in items:
            yield _classified(item, classes, loaded) if classes else item


def _classified(item: StreamItem, classes: dict[str, int], loaded: ModelVersion) -> StreamItem:
    """A decoupled model's response with the outputs asked for as classifications replaced."""
    response = item.response
    if response is None:
        return item
    batched = loaded.config.max_batch_size > 0
    try:
        outputs = classification.apply(response.outputs, classes, batched, loaded.labels)
    except errors.DlserveError as exc:
        return StreamItem(None, exc, item.final, item.model_version)
    response = InferResponse(response.model_name, response.model_version, response.id,
                             outputs, response.parameters)  # fmt: skip
    return StreamItem(response, item.error, item.final, item.model_version)


async def _run_decoupled(
    service: InferenceService, loaded: ModelVersion, request: InferRequest, call: Call,
    trace: Trace | None,
) -> AsyncGenerator[StreamItem, None]:  # fmt: skip
    """A decoupled model's request, through its scheduler like any other (queue policies,
    priorities, one ``execute`` at a time per instance); its responses as they come."""
    received = time.monotonic_ns()
    if trace is not None:
        trace.started(request.model_name, loaded.version, request.id, received)
    lease = call.lease if call.lease is not None else service.regions.lease(request)
    try:
        inputs, batch = loaded.validator.check(request)
        assert loaded.scheduler is not None
        job = loaded.scheduler.job(
            request.id, inputs, [o.name for o in request.outputs], request.parameters, batch,
            lease, chain=list(call.chain), lend=call.lend,
        )  # fmt: skip
        if trace is not None:
            job.item.trace_id = trace.id
            trace.queued(request, job.enqueued_ns)
        replies: asyncio.Queue[StreamReply] = asyncio.Queue()
        sink = StreamSink(replies.put_nowait, call.lend)
        worker, rid = await loaded.scheduler.run_stream(job, sink)
        loaded.streams.open(id(sink), _cutter(sink, worker, rid))  # an unload waits for it
        final = False
        try:
            while not final:
                each = await replies.get()
                worker.took(rid, sink, each)  # flow control: credit back to the model
                final = each.final
                if final and each.timings is not None:
                    service._record(loaded, WorkerReply([], each.timings), 1, received)
                item = _stream_item(loaded, request, each)
                if trace is not None:
                    _trace_response(trace, item, each)
                yield item
        finally:
            loaded.streams.close(id(sink))
            if not final:  # the consumer left: the model sees is_cancelled()
                sink.abandoned = True
                worker.cancel(rid)
    except errors.DlserveError as exc:
        loaded.stats.record_failure(time.monotonic_ns() - received, failure_reason(exc))
        if trace is not None:
            trace.stamp("REQUEST_END", time.monotonic_ns())
        yield StreamItem(None, exc, True)
    finally:
        if lease is not None:
            service.regions.release(lease)


def _trace_response(trace: Trace, item: StreamItem, each: StreamReply) -> None:
    """A decoupled response's outputs (TENSORS); with the final flag, the execution's
    timestamps and the request's end."""
    if item.response is not None:
        trace.outputs(item.response.outputs)
    if item.final:
        if each.timings is not None:
            trace.computed(WorkerReply([], each.timings), ())
        trace.stamp("REQUEST_END", time.monotonic_ns())


def _stream_item(loaded: ModelVersion, request: InferRequest, each: StreamReply) -> StreamItem:
    response = None
    if each.reply is not None:
        response = InferResponse(
            request.model_name, str(loaded.version), request.id,
            reply_outputs(loaded, each.reply), dict(each.reply.parameters),
        )  # fmt: skip
    return StreamItem(response, each.error, each.final, str(loaded.version))


class OpenStreams:
    """A model version's decoupled requests still streaming, and how to end each early:
    unloading waits for them (:meth:`drain`) as it waits for requests that execute."""

    def __init__(self) -> None:
        self._cuts: dict[int, Callable[[errors.DlserveError], None]] = {}
        self._none_left: asyncio.Event | None = None

    def open(self, key: int, cut: Callable[[errors.DlserveError], None]) -> None:
        self._cuts[key] = cut

    def close(self, key: int) -> None:
        self._cuts.pop(key, None)
        if not self._cuts and self._none_left is not None:
            self._none_left.set()

    async def drain(self, deadline: float, model: str) -> None:
        """Wait until every stream has ended, until ``deadline`` (monotonic seconds); end
        the ones still open with UNAVAILABLE (their clients read too slowly, or not at all,
        so their models wait for credit)."""
        while self._cuts and (remaining := deadline - time.monotonic()) > 0:
            self._none_left = asyncio.Event()
            try:
                await asyncio.wait_for(self._none_left.wait(), remaining)
            except TimeoutError:
                break
        failure = errors.UnavailableError(f"model '{model}' is being unloaded")
        for cut in list(self._cuts.values()):
            cut(failure)


def _cutter(
    sink: StreamSink, worker: WorkerHandle, rid: int
) -> Callable[[errors.DlserveError], None]:
    """How to end a stream early (its model is unloaded while its client reads too slowly):
    the consumer gets ``error`` as the final item, the model's responses still coming are
    dropped and it sees ``is_cancelled()`` (a send it waits in is released)."""

    def cut(error: errors.DlserveError) -> None:
        if not (sink.finished or sink.abandoned):
            sink.put(StreamReply(None, error, True))
        sink.abandoned = True
        worker.cancel(rid)

    return cut


def reply_outputs(loaded: ModelVersion, reply: WorkerReply) -> list[OutputTensor]:
    """A reply's outputs with the shapes the client sees; lent ones stay lent (BLS)."""
    if not loaded.validator.reshapes_outputs:  # the shapes are the model's own
        return reply.outputs
    shape = loaded.validator.output_shape
    return [
        OutputTensor(o.name, o.datatype, shape(o.name, o.shape), o.data, lent=o.lent)
        for o in reply.outputs
    ]
