"""A request's life in the core, in one place: the model version it addresses, the client
regions it names leased, its inputs checked, its wait in the version's scheduler, its
regions released, its statistics and trace stamps recorded; the response cache and the
classification extension applied on the way back.

Every path goes through :class:`RequestPipeline`: a unary request (:meth:`infer`), a
streamed one (:meth:`stream`: a decoupled model's responses as they come), an ensemble's
step (:meth:`step`, from ``calls/ensemble_steps.py``) and a BLS call (``calls/bls_router.py``
hands it to ``infer`` or ``stream`` as a request with a :class:`Call`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import time
from collections.abc import AsyncGenerator

from dlserve import errors
from dlserve.ipc import messages as m
from dlserve.server.core import classification
from dlserve.server.core.cache.response_cache import cacheable
from dlserve.server.core.calls import ensemble_steps
from dlserve.server.core.calls.ensemble import Lent, StepMemory
from dlserve.server.core.instances.decoupled_replies import StreamReply, StreamSink
from dlserve.server.core.instances.replies import WorkerReply
from dlserve.server.core.models.manager import ModelEntry, ModelManager, ModelVersion
from dlserve.server.core.models.repository import Repository
from dlserve.server.core.shm.registry import RegionLease, RegionRegistry
from dlserve.server.core.streaming import (
    NO_CALL,
    Call,
    StreamItem,
    reply_outputs,
    stream_cutter,
    stream_item,
)
from dlserve.server.core.telemetry.stats import failure_reason
from dlserve.server.core.telemetry.tracer import Trace
from dlserve.types import InferRequest, InferResponse, ModelState, OutputTensor, Parameters


class RequestPipeline:
    """What every request of the core goes through (module docstring). ``manager``: the
    loaded models; ``regions``: the client and BLS memory requests name."""

    def __init__(
        self, manager: ModelManager, repository: Repository, regions: RegionRegistry
    ) -> None:
        self.manager = manager
        self.repository = repository
        self.regions = regions

    def version(self, name: str, version: str = "") -> ModelVersion:
        """The version a request addresses; raises Triton's not-found errors."""
        entry = self.manager.entry(name)
        if entry is None or not entry.versions:
            raise _unknown(name, version, entry)
        if not version or version == "-1":
            found = entry.latest_ready()
            if found is None:
                raise errors.UnavailableError(
                    f"Request for unknown model: '{name}' has no available versions"
                )
            return found
        try:
            return entry.versions[int(version)]
        except (ValueError, KeyError):
            raise errors.NotFoundError(
                f"Request for unknown model: '{name}' version {version} is not found"
            ) from None

    # -- unary ---------------------------------------------------------------------------
    async def infer(
        self, request: InferRequest, call: Call = NO_CALL, trace: Trace | None = None
    ) -> InferResponse:
        """Run one request of a model that answers once. When its caller is cancelled (the
        client went away), a request still queued leaves the queue without being executed.
        ``call``: a BLS request's upstream models and the memory its inputs are in.
        ``trace``: the request's trace, when it is traced (the caller releases it)."""
        received = time.monotonic_ns()
        loaded = self.version(request.model_name, request.model_version)
        if trace is not None:
            trace.started(request.model_name, loaded.version, request.id, received)
        if loaded.decoupled:
            raise errors.DecoupledModelError(
                f"model '{request.model_name}' uses the decoupled transaction policy: use "
                "the streaming endpoint"
            )
        classes = classification.requested(request) if request.outputs else {}
        try:
            cache = loaded.cache
            if cache is not None and call is NO_CALL and cacheable(request):
                run = functools.partial(self._outputs, loaded, request, call, received, trace)
                outputs, parameters = await cache.outputs(request, received, run)
            else:
                outputs, parameters = await self._outputs(loaded, request, call, received, trace)
            if classes:
                batched = loaded.config.max_batch_size > 0
                outputs = classification.apply(outputs, classes, batched, loaded.labels)
        except errors.DlserveError as exc:
            loaded.stats.record_failure(time.monotonic_ns() - received, failure_reason(exc))
            raise
        except asyncio.CancelledError:
            loaded.stats.record_failure(time.monotonic_ns() - received, "CANCELED")
            raise
        finally:
            if trace is not None:
                trace.stamp("REQUEST_END", time.monotonic_ns())
        return InferResponse(
            request.model_name, str(loaded.version), request.id, outputs, parameters
        )

    async def _outputs(
        self, loaded: ModelVersion, request: InferRequest, call: Call, received: int,
        trace: Trace | None = None,
    ) -> tuple[list[OutputTensor], Parameters]:  # fmt: skip
        """The model's answer to ``request`` (an ensemble's: its steps'), counted."""
        if loaded.ensemble is not None:
            outputs = await ensemble_steps.run(self, loaded, request, received, trace)
            if trace is not None:
                trace.outputs(outputs)
            return outputs, {}
        reply = await self._execute(loaded, request, received, call, trace)
        outputs = reply_outputs(loaded, reply)
        if trace is not None:
            trace.computed(reply, outputs)
        return outputs, dict(reply.parameters) if reply.parameters else {}

    async def _execute(
        self, loaded: ModelVersion, request: InferRequest, received: int, call: Call,
        trace: Trace | None, keep: bool = False,
    ) -> WorkerReply:  # fmt: skip
        """Check the request, run it on an instance and count it in the version's
        statistics. ``keep``: its outputs stay in the worker's memory (an ensemble step's).

        The regions it names are checked first (as Triton does) and stay in use until it
        is done, so that unregistering one meanwhile cannot unmap it under the model.
        """
        assert loaded.scheduler is not None
        lease = call.lease if call.lease is not None else self.regions.lease(request)
        try:
            inputs, batch = loaded.validator.check(request)
            outputs = [o.name for o in request.outputs]
            job = loaded.scheduler.job(
                request.id, inputs, outputs, request.parameters, batch, lease, keep=keep,
                chain=list(call.chain), lend=call.lend,
            )  # fmt: skip
            if trace is not None:
                job.item.trace_id = trace.id
                trace.queued(request, job.enqueued_ns)
            reply = await loaded.scheduler.run(job)
        finally:
            if lease is not None:
                self.regions.release(lease)
        _record(loaded, reply.timings, batch, received)
        return reply

    # -- ensemble steps -----------------------------------------------------------------
    async def step(
        self, loaded: ModelVersion, request: InferRequest, memory: StepMemory,
        trace: Trace | None,
    ) -> tuple[list[OutputTensor], WorkerReply | None]:  # fmt: skip
        """An ensemble step's request of a model (not an ensemble), counted in its model's
        statistics; its outputs stay in the worker's memory (viewed, or lent when
        ``memory.lend``) for the caller to give back (``WorkerReply.held``; None: a cache
        hit, which holds nothing of a worker's). A step whose model uses the response
        cache goes through it unless it lends or borrows memory between workers."""
        received = time.monotonic_ns()
        if trace is not None:
            trace.started(request.model_name, loaded.version, request.id, received)
        try:
            cache = loaded.cache
            if cache is None or memory.lend or memory.spans or not cacheable(request):
                return await self._step_run(loaded, request, memory, received, trace)
            replies: list[WorkerReply] = []

            async def computed() -> tuple[list[OutputTensor], Parameters]:
                outputs, reply = await self._step_run(loaded, request, memory, received, trace)
                replies.append(reply)
                return outputs, {}

            outputs, _ = await cache.outputs(request, received, computed)
            return outputs, replies[0] if replies else None
        finally:
            if trace is not None:
                trace.stamp("REQUEST_END", time.monotonic_ns())

    async def _step_run(
        self, loaded: ModelVersion, request: InferRequest, memory: StepMemory, received: int,
        trace: Trace | None,
    ) -> tuple[list[OutputTensor], WorkerReply]:  # fmt: skip
        call = Call(lease=self._step_lease(request, memory.spans), lend=memory.lend)
        try:
            reply = await self._execute(loaded, request, received, call, trace, keep=True)
        except errors.DlserveError as exc:
            loaded.stats.record_failure(time.monotonic_ns() - received, failure_reason(exc))
            raise
        outputs = reply_outputs(loaded, reply)
        if trace is not None:
            trace.computed(reply, outputs)
        return outputs, reply

    def _step_lease(
        self, request: InferRequest, spans: dict[str, Lent] | None
    ) -> RegionLease | None:
        """A step's inputs that are earlier steps' lent outputs go by reference; the rest
        (client regions) are leased as for any request. None: lease as usual."""
        if not spans:
            return None
        others = [t for t in request.inputs if t.name not in spans]
        base = self.regions.lease(dataclasses.replace(request, inputs=others))
        if base is None:
            return self.regions.lease_spans({}, spans)
        return RegionLease({**base.inputs, **spans}, base.outputs, base.regions)

    # -- streams ------------------------------------------------------------------------
    async def stream(
        self, request: InferRequest, call: Call = NO_CALL, trace: Trace | None = None
    ) -> AsyncGenerator[StreamItem, None]:
        """Run a request over a stream: one item per response, the last one final. A model
        that answers once gives one item (:meth:`infer`); a decoupled model any number.
        Failures are items (the stream goes on); leaving early marks the request cancelled
        in the model. ``trace``: the request's trace, when it is traced (the caller
        releases it)."""
        try:
            loaded = self.version(request.model_name, request.model_version)
            if not loaded.decoupled:
                yield StreamItem(await self.infer(request, call, trace), None, True)
                return
            classes = classification.requested(request) if request.outputs else {}
        except errors.DlserveError as exc:
            yield StreamItem(None, exc, True)
            return
        decoupled = self._decoupled(loaded, request, call, trace)
        async with contextlib.aclosing(decoupled) as items:
            async for item in items:
                yield _classified(item, classes, loaded) if classes else item

    async def _decoupled(
        self, loaded: ModelVersion, request: InferRequest, call: Call, trace: Trace | None
    ) -> AsyncGenerator[StreamItem, None]:
        """A decoupled model's request, through its scheduler like any other (queue
        policies, priorities, one ``execute`` at a time per instance); its responses as
        they come."""
        received = time.monotonic_ns()
        if trace is not None:
            trace.started(request.model_name, loaded.version, request.id, received)
        lease = call.lease if call.lease is not None else self.regions.lease(request)
        try:
            inputs, batch = loaded.validator.check(request)
            assert loaded.scheduler is not None
            job = loaded.scheduler.job(
                request.id, inputs, [o.name for o in request.outputs], request.parameters,
                batch, lease, chain=list(call.chain), lend=call.lend,
            )  # fmt: skip
            if trace is not None:
                job.item.trace_id = trace.id
                trace.queued(request, job.enqueued_ns)
            replies: asyncio.Queue[StreamReply] = asyncio.Queue()
            sink = StreamSink(replies.put_nowait, call.lend)
            worker, rid = await loaded.scheduler.run_stream(job, sink)
            loaded.streams.open(id(sink), stream_cutter(sink, worker, rid))  # unload waits
            final = False
            try:
                while not final:
                    each = await replies.get()
                    worker.took(rid, sink, each)  # flow control: credit back to the model
                    final = each.final
                    if final:
                        _record(loaded, each.timings, 1, received)
                    item = stream_item(loaded, request, each)
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
                self.regions.release(lease)


def _unknown(name: str, version: str, entry: ModelEntry | None) -> errors.DlserveError:
    if entry is not None and entry.state == ModelState.UNAVAILABLE:
        return errors.UnavailableError(
            f"Request for unknown model: '{name}' has no available versions"
        )
    if version:
        return errors.NotFoundError(
            f"Request for unknown model: '{name}' version {version} is not found"
        )
    return errors.NotFoundError(f"Request for unknown model: '{name}' is not found")


def _record(loaded: ModelVersion, timings: m.Timings | None, batch: int, received: int) -> None:
    """A request's success in its version's statistics, from its worker's timestamps."""
    if timings is None:
        return
    now = time.monotonic_ns()
    loaded.stats.record_request(
        batch if loaded.validator.max_batch_size > 0 else 1,
        now - received,
        timings.input_start - received,
        timings.infer_start - timings.input_start,
        timings.infer_end - timings.infer_start,
        now - timings.infer_end,
    )


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


def _trace_response(trace: Trace, item: StreamItem, each: StreamReply) -> None:
    """A decoupled response's outputs (TENSORS); with the final flag, the execution's
    timestamps and the request's end."""
    if item.response is not None:
        trace.outputs(item.response.outputs)
    if item.final:
        if each.timings is not None:
            trace.computed(WorkerReply([], each.timings), ())
        trace.stamp("REQUEST_END", time.monotonic_ns())
