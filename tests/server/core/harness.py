"""The in-process core tier's tools: a real :class:`InferenceService` over a model repository
in a temporary folder, its instances run by the real worker loop in threads of the test
process (``--debug``'s in-process workers) or in worker processes where a test needs one to
die; requests built as the frontends build them; and the handshakes that let a test hold a
request inside a model and see where the core has put it.

Tests drive the core only through its public entry points (``infer``, ``infer_stream``,
``statistics``, ``metrics``, the repository API, ``startup`` and ``shutdown``), so that
refactoring what is behind them does not break them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import shutil
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from dlserve.server.core.models.manager import ManagerOptions
from dlserve.server.core.models.repository import Repository
from dlserve.server.core.service import InferenceService, ServiceOptions
from dlserve.tensors import dtypes
from dlserve.types import InferRequest, InferResponse, InputTensor, ParamValue

TEST_MODELS = Path(__file__).resolve().parents[2] / "models"
DEADLINE_S = 30.0  # what no step of a passing test comes near: a hang fails, it never waits it out
STOP_TIMEOUT_S = 10.0  # how long shutdown waits for in-flight requests of a failed test
POLL_S = 0.001  # how often a state the core reaches on its own is looked at (see until())


class Gate:
    """Holds a request inside the model's ``execute`` (or ``initialize``) until the test
    opens it: the test models' handshake on two FIFOs, named by the request's (or config's)
    parameters "started" and "go". The model writes a line to "started", then waits for a
    line on "go". Awaitable forms keep the event loop running (the core serves on while the
    test waits); the blocking forms stop it, to show what happens without the server."""

    def __init__(self, folder: Path) -> None:
        token = uuid.uuid4().hex
        self.started_fifo = folder / f"started-{token}"
        self.go_fifo = folder / f"go-{token}"
        for fifo in (self.started_fifo, self.go_fifo):
            os.mkfifo(fifo)
        self.parameters: dict[str, ParamValue] = {
            "started": str(self.started_fifo), "go": str(self.go_fifo),
        }  # fmt: skip
        self.is_started = False
        self.is_open = False

    async def started(self) -> None:
        await asyncio.to_thread(self.wait_started)

    async def open(self) -> None:
        await asyncio.to_thread(self.open_now)

    def wait_started(self) -> None:
        """Block until the held request (or load) has reached the model."""
        fd = os.open(self.started_fifo, os.O_RDONLY | os.O_NONBLOCK)
        try:
            readable, _, _ = select.select([fd], [], [], DEADLINE_S)
            assert readable, "the held request did not reach the model"
            assert os.read(fd, 64) == b"started\n"
        finally:
            os.close(fd)
        self.is_started = True

    def open_now(self) -> None:
        """Let the held request go on (the model is waiting for this line)."""
        with open(self.go_fifo, "w") as go:
            go.write("go\n")
        self.is_open = True

    def release(self) -> list[int]:
        """Let the held request pass whenever it comes, without waiting for it (a failed
        test's leftovers): a reader on "started" and the line on "go" wait in the FIFOs.
        Returns the descriptors that keep them there, to be closed afterwards."""
        if self.is_open:
            return []
        reader = os.open(self.started_fifo, os.O_RDONLY | os.O_NONBLOCK)
        writer = os.open(self.go_fifo, os.O_RDWR)  # a FIFO opened so never blocks (Linux)
        os.write(writer, b"go\n")
        self.is_open = True
        return [reader, writer]


class Core:
    """A model repository in a temporary folder, and services over it."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.repository = folder / "repository"
        self.repository.mkdir()
        self._gates: list[Gate] = []

    def add(self, *models: str) -> None:
        """Copy these test models (tests/models/NAME) into the repository."""
        for model in models:
            if not (self.repository / model).exists():
                shutil.copytree(TEST_MODELS / model, self.repository / model)

    def config(self, model: str) -> Path:
        """The model's config.pbtxt in the repository (a test may rewrite it)."""
        self.add(model)
        return self.repository / model / "config.pbtxt"

    def gate(self) -> Gate:
        gate = Gate(self.folder)
        self._gates.append(gate)
        return gate

    @contextlib.asynccontextmanager
    async def serving(
        self, *models: str, in_process: bool = True, bls_direct: bool = True
    ) -> AsyncIterator[InferenceService]:
        """A started service (explicit model control) with ``models`` loaded and READY;
        shut down afterwards. ``in_process=False``: each instance in a worker process
        (one that a model may end with ``os._exit``)."""
        self.add(*models)
        options = ServiceOptions(
            model_control_mode="explicit",
            startup_models=list(models),
            manager=ManagerOptions(in_process=in_process, stop_timeout=STOP_TIMEOUT_S),
            cpu_metrics=False,
            gpu_metrics=False,
            bls_direct=bls_direct,
        )
        service = InferenceService(Repository(self.repository), options)
        await service.startup()
        try:
            index = service.repository_api.index()
            assert all(service.model_ready(name) for name in models), index
            yield service
        finally:  # a failed test may leave requests held: they pass, and shutdown is quick
            kept = [fd for gate in self._gates for fd in gate.release()]
            try:
                await service.shutdown()
            finally:
                for fd in kept:
                    os.close(fd)


def tensor(name: str, values: Any, datatype: str | None = None) -> InputTensor:
    """An input as a frontend hands it to the core: its bytes, BYTES serialized as Triton's."""
    array = np.asarray(values)
    found = dtypes.from_wire(datatype) if datatype else dtypes.from_numpy(array.dtype)
    assert found is not None, array.dtype
    if found.is_bytes:
        data = dtypes.serialize_bytes(array)
    else:
        assert found.numpy is not None
        data = np.ascontiguousarray(array, dtype=found.numpy).tobytes()
    return InputTensor(name, found.wire, tuple(array.shape), memoryview(data))


def request(model: str, *inputs: InputTensor, **parameters: ParamValue) -> InferRequest:
    return InferRequest(model, "", uuid.uuid4().hex[:8], list(inputs), [], dict(parameters))


def output(response: InferResponse, name: str) -> np.ndarray[Any, Any]:
    """One output of a response, as an array."""
    for found in response.outputs:
        if found.name == name:
            assert found.data is not None, name
            dtype = dtypes.from_wire(found.datatype)
            assert dtype is not None, found.datatype
            if dtype.is_bytes:
                return dtypes.deserialize_bytes(found.data).reshape(found.shape)
            array = np.frombuffer(found.data, dtype=dtype.numpy_storage)
            return array.reshape(found.shape)
    raise AssertionError(f"no output {name} in {[o.name for o in response.outputs]}")


def scalars(response: InferResponse, names: Iterable[str]) -> dict[str, int]:
    """Integer outputs of one element each, by name (what the test models report)."""
    return {name: int(output(response, name).flat[0]) for name in names}


def metric(service: InferenceService, family: str, **labels: str) -> float:
    """A sample of the service's Prometheus text (what its metrics endpoint serves)."""
    text = service.metrics.render().decode()
    for found in text_string_to_metric_families(text):
        if found.name != family:  # (the parser names a counter's samples NAME_total)
            continue
        for sample in found.samples:
            if all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    raise AssertionError(f"no sample {family} {labels}")


def pending(service: InferenceService, model: str) -> int:
    """Triton's pending-request gauge: requests of ``model`` waiting for an execute, in
    the scheduler's queue or at a busy instance."""
    return int(metric(service, "nv_inference_pending_request_count", model=model, version="1"))


def failures(service: InferenceService, model: str, reason: str) -> int:
    return int(
        metric(service, "nv_inference_request_failure", model=model, reason=reason, version="1")
    )


async def until(condition: Callable[[], bool], what: str) -> None:
    """Wait for a state the core reaches on its own, in tasks the test does not hold (a
    request another task sent reaching its queue, an instance restarting): looked at
    between turns of the event loop, up to a deadline. Never a guess at how long it takes."""
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"not reached in {DEADLINE_S} s: {what}"
        await asyncio.sleep(POLL_S)


def in_flight(coroutine: Any) -> asyncio.Task[Any]:
    """Run ``coroutine`` as a task of its own: a client's request in flight."""
    return asyncio.ensure_future(coroutine)
