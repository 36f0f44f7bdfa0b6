"""Running an ensemble's steps through the request pipeline (the plan and its data flow
are in :mod:`dlserve.server.core.calls.ensemble`): each step is a request of its model,
counted in that model's statistics (``RequestPipeline.step``); a step's outputs stay in
the worker's memory (viewed, or lent by reference) until the ensemble request is over. A
step whose model uses the response cache goes through it (its tensors then pass through
the server: it neither lends nor borrows)."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from dlserve.server.core.calls.ensemble import StepMemory, run_ensemble
from dlserve.server.core.instances.lending import return_lent
from dlserve.types import InferRequest, OutputTensor

if TYPE_CHECKING:
    from dlserve.server.core.models.manager import ModelVersion
    from dlserve.server.core.pipeline import RequestPipeline
    from dlserve.server.core.telemetry.tracer import Trace


async def run(
    pipeline: RequestPipeline, loaded: ModelVersion, request: InferRequest, received: int,
    trace: Trace | None = None,
) -> list[OutputTensor]:  # fmt: skip
    """An ensemble request: its steps, then the ensemble's own statistics. A traced
    ensemble request's steps are traced too, as its children."""
    assert loaded.ensemble is not None
    inputs, batch = loaded.validator.check(request)
    if trace is not None:
        trace.queued(request, time.monotonic_ns())
    outputs = await run_ensemble(
        loaded.ensemble, request, inputs, functools.partial(_run_step, pipeline, trace),
        lends=functools.partial(_lends, pipeline),
    )  # fmt: skip
    total = time.monotonic_ns() - received
    loaded.stats.record_request(batch if loaded.config.max_batch_size > 0 else 1,
                                total, 0, 0, 0, 0)  # fmt: skip
    loaded.stats.execution_count += 1
    return outputs


def _lends(pipeline: RequestPipeline, model: str) -> bool:
    """Whether a step's model lends and borrows memory between workers: a Python model
    that does not use the response cache (a cached step's tensors pass through the server,
    to be hashed and kept)."""
    if pipeline.repository.is_ensemble(model):
        return False
    entry = pipeline.manager.entry(model)
    return entry is None or all(v.cache is None for v in entry.versions.values())


async def _run_step(
    pipeline: RequestPipeline, parent: Trace | None, request: InferRequest, memory: StepMemory
) -> tuple[list[OutputTensor], Callable[[], None]]:
    """One ensemble step, counted in its model's statistics; its outputs stay in the
    worker's memory (viewed, or lent) until the returned callable gives them back (a cache
    hit, ``reply`` None, holds nothing of a worker's). A traced ensemble request's step is
    traced as its child."""
    trace = parent.child(request.model_name) if parent is not None else None
    try:
        loaded = pipeline.version(request.model_name, request.model_version)
        if loaded.ensemble is not None:
            response = await pipeline.infer(request, trace=trace)
            return response.outputs, _nothing
        outputs, reply = await pipeline.step(loaded, request, memory, trace)
    finally:
        if trace is not None:
            trace.release()
    release_held: Callable[[], None] = _nothing
    if reply is not None and reply.worker is not None and reply.held:
        release_held = functools.partial(reply.worker.release_outputs, reply.held)
    if not any(o.lent is not None for o in outputs):
        return outputs, release_held
    return outputs, functools.partial(_give_back, release_held, outputs)


def _give_back(release_held: Callable[[], None], outputs: list[OutputTensor]) -> None:
    release_held()
    return_lent(outputs)


def _nothing() -> None:
    """An ensemble step whose outputs hold nothing that must be given back."""
