"""pb_utils' runtime in a worker: what model code asks of the server goes over the link.

pb_utils imports nothing of the worker (``pb_utils/runtime.py`` says why); a worker
installs :data:`WORKER_RUNTIME` when it starts (``worker/main.py``'s ``install_pb_utils``).
Each call finds the calling thread's link (``link.current()``): an in-process worker's is
per thread, a worker process's is also the default of the threads the model starts. A
thread with no link gets pb_utils' errors for a program that is no worker.
"""

from __future__ import annotations

from dlserve.ipc import messages as m
from dlserve.pb_utils.exceptions import TritonModelException
from dlserve.pb_utils.runtime import outside_metrics
from dlserve.worker.bls import model_calls as calls
from dlserve.worker.link import link


class WorkerRuntime:
    """pb_utils' ModelRuntime: BLS and model control (``worker/bls/model_calls.py``), custom
    metrics and the model's name (the link)."""

    def __init__(self) -> None:
        # the functions themselves, found in the instance: exec() pays no extra call
        self.execute = calls.execute
        self.async_execute = calls.async_execute

    def load_model(self, model_name: str, config: str, files: dict[str, bytes]) -> None:
        calls.control("load", model_name, config=config, files=files)

    def unload_model(self, model_name: str, unload_dependents: bool) -> None:
        calls.control("unload", model_name, unload_dependents=unload_dependents)

    def is_model_ready(self, model_name: str, model_version: str) -> bool:
        return calls.control("ready", model_name, model_version=model_version)

    def send_metric(self, what: str, message: m.MetricFamilyDef | m.MetricOp) -> None:
        worker = link.current()
        if worker is None:
            raise outside_metrics(what)
        worker.send(message)

    def metric_value(self, what: str, family: str, labels: dict[str, str]) -> float:
        worker = link.current()
        if worker is None:
            raise outside_metrics(what)
        try:
            return worker.call(m.MetricValueCall(worker.next_call_id(), family, labels)).value
        except TritonModelException as exc:
            raise TritonModelException(f"{what}: {exc}") from None

    def model_name(self) -> str:
        worker = link.current()
        return worker.model_name if worker is not None else ""


WORKER_RUNTIME = WorkerRuntime()
