"""Running an ensemble's steps through the service (the plan and its data flow are in
:mod:`dlserve.server.core.calls.ensemble`): each step is a request of its model, counted in that
model's statistics; a step's outputs stay in the worker's memory (viewed, or lent by reference)
until the ensemble request is over. A step whose model uses the response cache goes
through it (its tensors then pass through the server: it neither lends nor borrows)."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from dlserve import errors
from dlserve.server.core.cache.response_cache import cacheable
from dlserve.server.core.calls.ensemble import Lent, StepMemory, run_ensemble
from dlserve.server.core.instances.lending import return_lent
from dlserve.server.core.shm.registry import RegionLease
from dlserve.server.core.streams import Call
from dlserve.server.core.telemetry.stats import failure_reason
from dlserve.types import InferRequest, OutputTensor, Parameters

if TYPE_CHECKING:
    from dlserve.server.core.models.manager import ModelVersion
    from dlserve.server.core.service import InferenceService
    from dlserve.server.core.telemetry.tracer import Trace


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
        lends=functools.partial(_lends, service),
    )  # fmt: skip
    total = time.monotonic_ns() - received
    loaded.stats.record_request(batch if loaded.config.max_batch_size > 0 else 1,
                                total, 0, 0, 0, 0)  # fmt: skip
    loaded.stats.execution_count += 1
    return outputs


def _lends(service: InferenceService, model: str) -> bool:
    """Whether a step's model lends and borrows memory between workers: a Python model
    that does not use the response cache (a cached step's tensors pass through the server,
    to be hashed and kept)."""
    if service.repository.is_ensemble(model):
        return False
    entry = service.manager.entry(model)
    return entry is None or all(v.cache is None for v in entry.versions.values())


async def _run_step(
    service: InferenceService, parent: Trace | None, request: InferRequest, memory: StepMemory
) -> tuple[list[OutputTensor], Callable[[], None]]:
    """One ensemble step, counted in its model's statistics; its outputs stay in the
    worker's memory (viewed, or lent) until the returned callable gives them back. A step
    whose model uses the response cache is answered from it when it can be. A traced
    ensemble request's step is traced as its child."""
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
    try:
        cache = loaded.cache
        if cache is None or memory.lend or memory.spans or not cacheable(request):
            return await _run_model(service, loaded, request, memory, received, trace)
        release: list[Callable[[], None]] = [_nothing]

        async def computed() -> tuple[list[OutputTensor], Parameters]:
            outputs, release[0] = await _run_model(
                service, loaded, request, memory, received, trace
            )
            return outputs, {}

        outputs, _ = await cache.outputs(request, received, computed)
        return outputs, release[0]  # a hit holds nothing of a worker's
    finally:
        if trace is not None:
            trace.stamp("REQUEST_END", time.monotonic_ns())


async def _run_model(
    service: InferenceService, loaded: ModelVersion, request: InferRequest,
    memory: StepMemory, received: int, trace: Trace | None,
) -> tuple[list[OutputTensor], Callable[[], None]]:  # fmt: skip
    call = Call(lease=_step_lease(service, request, memory.spans), lend=memory.lend)
    try:
        reply, batch = await service._run(loaded, request, keep=True, call=call, trace=trace)
    except errors.DlserveError as exc:
        loaded.stats.record_failure(time.monotonic_ns() - received, failure_reason(exc))
        raise
    service._record(loaded, reply, batch, received)
    shape = loaded.validator.output_shape
    outputs = [OutputTensor(o.name, o.datatype, shape(o.name, o.shape), o.data, lent=o.lent)
               for o in reply.outputs]  # fmt: skip
    if trace is not None:
        trace.computed(reply, outputs)
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
