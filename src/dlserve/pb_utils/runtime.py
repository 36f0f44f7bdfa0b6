"""What pb_utils needs from the process that runs the model, and the slot it is installed in.

pb_utils is Triton's model-facing API and nothing else: what needs the server (BLS calls,
model control, custom metrics) or knows which model runs (Logger's lines) goes through
the :class:`ModelRuntime` installed here. A dlserve worker installs its own when it starts
(``worker/main.py``, in-process workers too); until then, in a program that is no worker,
each such call raises a TritonModelException that says so (the same one a worker raises
in a thread it does not serve), and Logger's lines name no model.

What belongs to one request (its response sender, the poll that reads a Cancel, its
output buffers) the worker sets on the request it hands to ``execute``, not here.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

from dlserve.pb_utils.exceptions import TritonModelException

if TYPE_CHECKING:
    from dlserve.ipc import messages as m
    from dlserve.pb_utils.request import InferenceRequest, InferenceResponse


class ModelRuntime(Protocol):
    """The services of the process that runs the model; ``what`` names the pb_utils call
    for its error messages."""

    def execute(
        self, request: InferenceRequest, decoupled: bool
    ) -> InferenceResponse | Iterator[InferenceResponse]:
        """``InferenceRequest.exec()``: the response, or the responses of a decoupled model."""
        ...

    async def async_execute(
        self, request: InferenceRequest, decoupled: bool
    ) -> InferenceResponse | Iterator[InferenceResponse]:
        """``InferenceRequest.async_exec()``."""
        ...

    def load_model(self, model_name: str, config: str, files: dict[str, bytes]) -> None: ...

    def unload_model(self, model_name: str, unload_dependents: bool) -> None: ...

    def is_model_ready(self, model_name: str, model_version: str) -> bool: ...

    def send_metric(self, what: str, message: m.MetricFamilyDef | m.MetricOp) -> None:
        """A custom metric's definition or update, to the server (one-way)."""
        ...

    def metric_value(self, what: str, family: str, labels: dict[str, str]) -> float:
        """A custom metric's value, as the server has it after every earlier update; what
        keeps it from the model is raised as ``what: why``."""
        ...

    def model_name(self) -> str:
        """The model the calling thread runs ("" when none)."""
        ...


def outside_execute(what: str) -> TritonModelException:
    """The error of a BLS call or model control where no model's ``execute`` runs."""
    return TritonModelException(f"{what} is only available inside a model's execute()")


def outside_metrics(what: str) -> TritonModelException:
    """The error of a custom metric where no worker runs the model."""
    return TritonModelException(
        f"{what}: custom metrics are only available in a model run by a dlserve worker"
    )


class NoWorker:
    """The runtime of a program that is no worker: what needs one raises."""

    def execute(
        self, request: InferenceRequest, decoupled: bool
    ) -> InferenceResponse | Iterator[InferenceResponse]:
        raise outside_execute("InferenceRequest.exec()")

    async def async_execute(
        self, request: InferenceRequest, decoupled: bool
    ) -> InferenceResponse | Iterator[InferenceResponse]:
        raise outside_execute("InferenceRequest.async_exec()")

    def load_model(self, model_name: str, config: str, files: dict[str, bytes]) -> None:
        raise outside_execute("pb_utils.load_model")

    def unload_model(self, model_name: str, unload_dependents: bool) -> None:
        raise outside_execute("pb_utils.unload_model")

    def is_model_ready(self, model_name: str, model_version: str) -> bool:
        raise outside_execute("pb_utils.is_model_ready")

    def send_metric(self, what: str, message: m.MetricFamilyDef | m.MetricOp) -> None:
        raise outside_metrics(what)

    def metric_value(self, what: str, family: str, labels: dict[str, str]) -> float:
        raise outside_metrics(what)

    def model_name(self) -> str:
        return ""


NO_WORKER = NoWorker()
_installed: ModelRuntime = NO_WORKER


def install(runtime: ModelRuntime) -> ModelRuntime:
    """Make ``runtime`` the one pb_utils uses in this process; the one it replaces."""
    global _installed
    previous, _installed = _installed, runtime
    return previous


def current() -> ModelRuntime:
    """The installed runtime (:data:`NO_WORKER` until a worker installs its own)."""
    return _installed
