"""Running an ensemble's steps through the service (the plan and its data flow are in
:mod:`dlserve.core.ensemble`): each step is a request of its model, counted in that model's
statistics; a step's outputs stay in the worker's memory (viewed, or lent by reference)
until the ensemble request is over."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from dlserve import errors
from dlserve.core.ensemble import Lent, StepMemory, run_ensemble
from dlserve.core.regions import RegionLease
from dlserve.core.stats import failure_reason
from dlserve.core.streams import Call
from dlserve.types import InferRequest, OutputTensor
from dlserve.workers.lending import return_lent

if TYPE_CHECKING:
    from dlserve.core.manager import ModelVersion
    from dlserve.core.service import InferenceService
    from dlserve.core.tracer import Trace


async def run(
    service: InferenceService, loaded: ModelVersion, request: InferRequest, received: int,
    trace: Trace | None = None,
) -> list[OutputTensor]:  # fmt: skip
    """An ensemble request: its steps, then the ensemble's own statistics. A traced
    ensemble request's steps are traced too, as its children."""
    assert loaded.ensemble is not None
    inputs, batch = loaded.validator.check(request)
    if trace is not None:
        trace.queued(request, time.monotonic_ns())
    outputs = await run_ensemble(
        loaded.ensemble, request, inputs, functools.partial(_run_step, service, trace),
        lends=lambda model: not service.repository.is_ensemble(model),
    )  # fmt: skip
    total = time.monotonic_ns() - received
    loaded.stats.record_request(batch if loaded.config.max_batch_size > 0 else 1,
                                total, 0, 0, 0, 0)  # fmt: skip
    loaded.stats.execution_count += 1
    return outputs


async def _run_step(
    service: InferenceService, parent: Trace | None, request: InferRequest, memory: StepMemory
) -> tuple[list[OutputTensor], Callable[[], None]]:
    """One ensemble step, counted in its model's statistics; its outputs stay in the
    worker's memory (viewed, or lent) until the returned callable gives them back."""
    trace = parent.child(request.model_name) if parent is not None else None
    try:
        return await _step(service, trace, request, memory)
    finally:
        if trace is not None:
            trace.release()


async def _step(
    service: InferenceService, trace: Trace | None, request: InferRequest, memory: StepMemory
) -> tuple[list[OutputTensor], Callable[[], None]]:
    received = time.monotonic_ns()
    loaded = service.version(request.model_name, request.model_version)
    if loaded.ensemble is not None:
        response = await service.infer(request, trace=trace)
        return response.outputs, _nothing
    if trace is not None:
        trace.started(request.model_name, loaded.version, request.id, received)
    call = Call(lease=_step_lease(service, request, memory.spans), lend=memory.lend)
    try:
        reply, batch = await service._run(loaded, request, keep=True, call=call, trace=trace)
    except errors.DlserveError as exc:
        loaded.stats.record_failure(time.monotonic_ns() - received, failure_reason(exc))
        if trace is not None:
            trace.stamp("REQUEST_END", time.monotonic_ns())
        raise
    service._record(loaded, reply, batch, received)
    shape = loaded.validator.output_shape
    outputs = [OutputTensor(o.name, o.datatype, shape(o.name, o.shape), o.data, lent=o.lent)
               for o in reply.outputs]  # fmt: skip
    if trace is not None:
        trace.computed(reply, outputs)
        trace.stamp("REQUEST_END", time.monotonic_ns())
    worker, held = reply.worker, reply.held
    release_held = (functools.partial(worker.release_outputs, held)
                    if worker is not None and held else _nothing)  # fmt: skip
    if not any(o.lent is not None for o in outputs):
        return outputs, release_held
    return outputs, functools.partial(_give_back, release_held, outputs)


def _step_lease(
    service: InferenceService, request: InferRequest, spans: dict[str, Lent] | None
) -> RegionLease | None:
    """A step's inputs that are earlier steps' lent outputs go by reference; the rest
    (client regions) are leased as for any request. None: lease as usual."""
    if not spans:
        return None
    others = [t for t in request.inputs if t.name not in spans]
    base = service.regions.lease(dataclasses.replace(request, inputs=others))
    if base is None:
        return service.regions.lease_spans({}, spans)
    return RegionLease({**base.inputs, **spans}, base.outputs, base.regions)


def _give_back(release_held: Callable[[], None], outputs: list[OutputTensor]) -> None:
    release_held()
    return_lent(outputs)


def _nothing() -> None:
    """An ensemble step whose outputs hold nothing that must be given back."""
