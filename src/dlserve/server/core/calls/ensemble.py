"""Ensembles (``platform: "ensemble"``): the server runs the steps, in dependency order.

A step's inputs are the ensemble's inputs or earlier steps' outputs (``input_map``:
the step model's input -> an ensemble tensor; ``output_map``: the step model's output
-> an ensemble tensor). Steps whose inputs are all there run together.

How tensors travel between steps: by reference where they can. A step whose outputs
are all intermediate (no ensemble output among them) and read only by Python models runs
as a *lending* request, as a BLS call does: its large host outputs stay in its worker's
output arena and the next step's worker maps them (``PEER_ARENA``); its GPU outputs stay
in its GPU memory and the next worker opens them by CUDA IPC handle (``CUDA_IPC``). No
copy. What is lent goes back to the producing worker when the ensemble request is over.
Other steps' outputs stay in the worker's output arena (the server keeps a view) and are
copied once into the next worker's input arena, as any input (small tensors ride in the
frame). Final outputs are copied out once into the response, or written by the producing
step straight into the client's shared-memory region when the request asks for that.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from dlserve import errors
from dlserve.server.core.models.config import ConfigError
from dlserve.types import (
    ArenaSpan,
    CudaSpan,
    InferRequest,
    InputTensor,
    OutputTensor,
    RegionRef,
    RequestedOutput,
)


@dataclass(frozen=True, slots=True)
class Step:
    model_name: str
    model_version: str  # "" : the model's latest ready version
    inputs: dict[str, str]  # step model's input -> ensemble tensor
    outputs: dict[str, str]  # step model's output -> ensemble tensor


@dataclass(frozen=True, slots=True)
class EnsemblePlan:
    name: str
    steps: tuple[Step, ...]  # an order in which every step's inputs exist before it runs
    outputs: tuple[str, ...]  # the ensemble's outputs

    @property
    def models(self) -> list[str]:
        return sorted({step.model_name for step in self.steps})


Lent = ArenaSpan | CudaSpan


@dataclass(frozen=True, slots=True)
class StepMemory:
    """How a step's tensors travel: ``lend`` its outputs by reference; ``spans``: its
    inputs that are earlier steps' lent outputs, by the step model's input name."""

    lend: bool = False
    spans: dict[str, Lent] | None = None


# Runs one step's request: the outputs, and a callable that gives back what they hold.
StepRunner = Callable[
    [InferRequest, StepMemory], Awaitable[tuple[list[OutputTensor], Callable[[], None]]]
]


def plan_ensemble(config: Any) -> EnsemblePlan:
    """The steps in dependency order; raises ConfigError for what cannot run."""
    name = config.name
    if not config.HasField("ensemble_scheduling") or not config.ensemble_scheduling.step:
        raise ConfigError(f"ensemble '{name}' must specify ensemble_scheduling with steps")
    steps = [_step(name, s) for s in config.ensemble_scheduling.step]
    _check_producers(name, steps, {o.name for o in config.output})
    available = {i.name for i in config.input}
    ordered: list[Step] = []
    while steps:
        ready = [s for s in steps if set(s.inputs.values()) <= available]
        if not ready:
            missing = sorted(set().union(*(set(s.inputs.values()) for s in steps)) - available)
            raise ConfigError(
                f"ensemble '{name}': no step can run: tensor(s) {missing} are neither "
                "ensemble inputs nor outputs of a step that can run before (or steps form "
                "a cycle)"
            )
        for step in ready:
            ordered.append(step)
            available |= set(step.outputs.values())
        steps = [s for s in steps if s not in ready]
    return EnsemblePlan(name, tuple(ordered), tuple(o.name for o in config.output))


def _step(name: str, step: Any) -> Step:
    if not step.model_name:
        raise ConfigError(f"ensemble '{name}': every step must name a model_name")
    version = "" if step.model_version in (-1, 0) else str(step.model_version)
    return Step(step.model_name, version, dict(step.input_map), dict(step.output_map))


def _check_producers(name: str, steps: list[Step], outputs: set[str]) -> None:
    produced: set[str] = set()
    for step in steps:
        for tensor in step.outputs.values():
            if tensor in produced:
                raise ConfigError(
                    f"ensemble '{name}': ensemble tensor '{tensor}' is the output of more "
                    "than one step"
                )
            produced.add(tensor)
    missing = sorted(outputs - produced)
    if missing:
        raise ConfigError(f"ensemble '{name}': output(s) {missing} are not produced by any step")


async def run_ensemble(
    plan: EnsemblePlan,
    request: InferRequest,
    inputs: list[InputTensor],
    run_step: StepRunner,
    lends: Callable[[str], bool] = lambda model: False,
) -> list[OutputTensor]:
    """Run ``plan`` for ``request`` (whose checked inputs are ``inputs``); the outputs the
    request asks for, in the order it names them (every output when it names none).
    ``lends(model)``: whether that model's worker can lend and borrow memory (a Python
    model, not an ensemble)."""
    wanted = [o.name for o in request.outputs] or list(plan.outputs)
    regions = {o.name: o for o in request.outputs if o.region is not None}
    tensors: dict[str, InputTensor | OutputTensor] = {t.name: t for t in inputs}
    releases: list[Callable[[], None]] = []
    lending = _lending_steps(plan, lends)
    try:
        pending = list(plan.steps)
        while pending:
            wave = [s for s in pending if set(s.inputs.values()) <= tensors.keys()]
            pending = [s for s in pending if s not in wave]
            sub_requests = [_step_request(s, request, tensors, regions) for s in wave]
            results = await _gather(
                run_step(r, StepMemory(id(step) in lending, spans))
                for step, (r, spans) in zip(wave, sub_requests, strict=True)
            )
            for step, (outputs, release) in zip(wave, results, strict=True):
                releases.append(release)
                for output in outputs:
                    tensors[step.outputs[output.name]] = output
        return [_final(name, tensors[name]) for name in wanted]
    finally:
        for release in releases:
            release()


async def _gather(
    calls: Any,
) -> list[tuple[list[OutputTensor], Callable[[], None]]]:
    """Run the wave's steps together; the first failure cancels the others."""
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        for result in await asyncio.gather(*tasks, return_exceptions=True):
            if isinstance(result, tuple):
                result[1]()
        raise


def _lending_steps(plan: EnsemblePlan, lends: Callable[[str], bool]) -> set[int]:
    """The steps (by id) that run as lending requests: a Python model whose outputs are
    all intermediate and read only by Python models."""
    readers: dict[str, list[Step]] = {}
    for step in plan.steps:
        for tensor in step.inputs.values():
            readers.setdefault(tensor, []).append(step)
    final = set(plan.outputs)
    return {
        id(step)
        for step in plan.steps
        if lends(step.model_name)
        and not final & set(step.outputs.values())
        and all(lends(r.model_name) for t in step.outputs.values() for r in readers.get(t, []))
    }


def _step_request(
    step: Step,
    request: InferRequest,
    tensors: dict[str, InputTensor | OutputTensor],
    regions: dict[str, RequestedOutput],
) -> tuple[InferRequest, dict[str, Lent]]:
    inputs: list[InputTensor] = []
    spans: dict[str, Lent] = {}
    for model_input, tensor_name in step.inputs.items():
        tensor = tensors[tensor_name]
        if isinstance(tensor, InputTensor):
            inputs.append(InputTensor(model_input, tensor.datatype, tensor.shape, tensor.data,
                                      tensor.parameters, tensor.region))  # fmt: skip
            continue
        if tensor.lent is not None:  # by reference: the worker maps the producer's memory
            region = RegionRef("", tensor.lent.byte_size)
            inputs.append(InputTensor(model_input, tensor.datatype, tensor.shape, None, {},
                                      region))  # fmt: skip
            spans[model_input] = tensor.lent
            continue
        if tensor.data is None:
            raise errors.UnsupportedError(
                f"ensemble tensor '{tensor_name}' is written into a shared-memory region and "
                "also read by a later step; request it without shared memory"
            )
        data = tensor.data if isinstance(tensor.data, memoryview) else memoryview(tensor.data)
        inputs.append(InputTensor(model_input, tensor.datatype, tensor.shape, data))
    outputs = []
    for model_output, tensor_name in step.outputs.items():
        target = regions.get(tensor_name)
        outputs.append(RequestedOutput(model_output, region=target.region if target else None))
    sub_request = InferRequest(
        step.model_name, step.model_version, request.id, inputs, outputs,
        dict(request.parameters), request.peer,
    )  # fmt: skip
    return sub_request, spans


def _final(name: str, tensor: InputTensor | OutputTensor) -> OutputTensor:
    """An ensemble output, its bytes copied out of any worker arena they are still in."""
    data = tensor.data
    if isinstance(data, memoryview):
        data = bytes(data)
    return OutputTensor(name, tensor.datatype, tensor.shape, data)
