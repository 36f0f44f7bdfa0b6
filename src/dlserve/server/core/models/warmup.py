"""Model warmup (config.pbtxt ``model_warmup``), run as Triton runs it.

Each sample is a batch of ``batch_size`` requests (each of batch 1 when the model
batches) given to one ``execute`` call, ``count`` times (at least once), on every instance
after its ``initialize`` and before the model is READY. Inputs hold zeros
(``zero_data``), random bytes (``random_data``; BYTES inputs get empty strings, as in
Triton) or the bytes of a file in the model's ``warmup/`` folder (``input_data_file``).
A sample whose responses carry errors fails the load: the model is UNAVAILABLE with
Triton's message. Warmup runs bypass the scheduler and are not counted in the model's
statistics.
"""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dlserve import errors
from dlserve.server.core.instances.handle import WorkerHandle, WorkItem
from dlserve.server.core.instances.pool import WorkerPool
from dlserve.server.core.instances.replies import Outcome
from dlserve.server.core.models.config import ConfigError
from dlserve.server.core.request_validator import RequestValidator
from dlserve.tensors import dtypes
from dlserve.types import InferRequest, InputTensor

WARMUP_FOLDER = "warmup"  # in the model's folder, as in Triton


@dataclass(frozen=True, slots=True)
class Sample:
    """One warmup sample: ``requests`` (one list of inputs each) run together, ``count``
    times."""

    name: str
    count: int
    requests: list[list[InputTensor]]


def plan(config: Any, model_dir: Path) -> list[Sample]:
    """The config's warmup samples with their data; raises ConfigError as Triton words it."""
    validator = RequestValidator(config)
    samples = []
    for setting in config.model_warmup:
        if setting.batch_size == 0:
            continue  # Triton skips these too
        batched = config.max_batch_size > 0
        inputs = [
            _input(name, spec, batched and name in validator.inputs, model_dir)
            for name, spec in sorted(setting.inputs.items())
        ]
        requests = [list(inputs) for _ in range(setting.batch_size)]
        _check(validator, config.name, setting.name, inputs)
        samples.append(Sample(setting.name, max(setting.count, 1), requests))
    return samples


def _input(name: str, spec: Any, batched: bool, model_dir: Path) -> InputTensor:
    dims = [int(d) for d in spec.dims]
    if any(d < 0 for d in dims):
        raise ConfigError(
            f"warmup setting expects all variable-size dimensions are specified for input '{name}'"
        )
    dtype = dtypes.BY_CONFIG_CODE.get(spec.data_type)
    if dtype is None:
        raise ConfigError(f"warmup setting gives input '{name}' no valid data_type")
    count = math.prod(dims)
    nbytes = count * (4 if dtype.is_bytes else dtype.itemsize)  # BYTES: empty strings
    which = spec.WhichOneof("input_data_type")
    if which == "zero_data" or (which == "random_data" and dtype.is_bytes):
        data = bytes(nbytes)
    elif which == "random_data":
        data = os.urandom(nbytes)
    elif which == "input_data_file":
        data = _file_data(model_dir, spec.input_data_file, nbytes, dtype.is_bytes)
    else:
        raise ConfigError(f"warmup setting expects input '{name}' to have input_data_type set")
    shape = (1, *dims) if batched else tuple(dims)
    return InputTensor(name, dtype.wire, shape, memoryview(data))


def _file_data(model_dir: Path, name: str, nbytes: int, whole: bool) -> bytes:
    """A sample's data from ``<model>/warmup/<name>``: all of it for BYTES (serialized as
    Triton serializes BYTES tensors), else its first ``nbytes``."""
    folder = (model_dir / WARMUP_FOLDER).resolve()
    path = (folder / name).resolve()
    if not path.is_relative_to(folder):
        raise ConfigError(f"warmup data file '{name}' is outside the model's warmup folder")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"unable to read warmup data file '{name}': {exc.strerror}") from None
    if whole:
        return data
    if len(data) < nbytes:
        raise ConfigError(
            f"warmup setting expects {nbytes} bytes, but the data provided from {name} only "
            f"has {len(data)} bytes"
        )
    return data[:nbytes]


def _check(validator: RequestValidator, model: str, sample: str, inputs: list[InputTensor]) -> None:
    """The model's own inputs must make a valid request (others, such as a sequence
    batcher's control inputs, are passed as they are)."""
    own = [t for t in inputs if t.name in validator.inputs]
    try:
        validator.check(InferRequest(model, "", "", own, []))
    except errors.DlserveError as exc:
        raise ConfigError(f"warmup sample '{sample}' is not a valid request: {exc}") from None


async def run(pool: WorkerPool, samples: Sequence[Sample]) -> None:
    """Run every sample on every instance, one execute at a time per instance."""
    if samples:
        await asyncio.gather(*(_warm(w, samples) for w in pool.workers if w is not None))


async def _warm(worker: WorkerHandle, samples: Sequence[Sample]) -> None:
    for sample in samples:
        for _ in range(sample.count):
            failures = await _execute(worker, sample.requests)
            if failures:
                raise errors.InvalidArgumentError(
                    f"failed to run warmup sample '{sample.name}': "
                    + "".join(f"{message}; " for message in failures)
                )


async def _execute(worker: WorkerHandle, requests: list[list[InputTensor]]) -> list[str]:
    """One execute of ``requests`` on ``worker``; the error messages of their responses."""
    loop = asyncio.get_running_loop()
    futures: list[asyncio.Future[Outcome]] = [loop.create_future() for _ in requests]
    items = [WorkItem("", inputs, [], {}) for inputs in requests]
    worker.submit(items, [future.set_result for future in futures])
    failures = []
    for outcome in await asyncio.gather(*futures):
        if isinstance(outcome, errors.DlserveError):
            raise outcome  # the worker died
        if outcome.error is not None:  # (outputs were read on arrival, their space given back)
            failures.append(str(outcome.error))
    return failures
