"""pb_utils' runtime: the model API imports nothing of the worker, a worker installs its
runtime when it starts, and where no worker runs a model each call that needs one says so
with its own error."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Callable

import pytest

from dlserve import pb_utils as pb_utils
from dlserve.pb_utils import runtime
from dlserve.worker.link import link
from dlserve.worker.main import install_pb_utils
from dlserve.worker.pb_utils_runtime import WORKER_RUNTIME


def test_pb_utils_imports_no_worker_module() -> None:
    """Importing the model API (and using it outside a worker) loads no worker module."""
    code = (
        "import sys\n"
        "from dlserve import pb_utils\n"
        "pb_utils.Logger.log_info('alone')\n"
        "print(sorted(name for name in sys.modules if name.startswith('dlserve.worker')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "[]"
    assert done.stderr.endswith("] alone\n")  # no worker: the line names no model


def test_a_worker_installs_its_runtime_at_start() -> None:
    previous = runtime.install(runtime.NO_WORKER)
    try:
        install_pb_utils()  # what a worker process and an in-process worker do first
        assert runtime.current() is WORKER_RUNTIME
        assert sys.modules["triton_python_backend_utils"] is pb_utils
    finally:
        runtime.install(previous)


def bls_request() -> pb_utils.InferenceRequest:
    return pb_utils.InferenceRequest(model_name="m", inputs=[], requested_output_names=[])


OUTSIDE_EXECUTE: list[tuple[str, Callable[[], object]]] = [
    ("InferenceRequest.exec()", lambda: bls_request().exec()),
    ("InferenceRequest.async_exec()", lambda: asyncio.run(bls_request().async_exec())),
    ("pb_utils.load_model", lambda: pb_utils.load_model("m")),
    ("pb_utils.unload_model", lambda: pb_utils.unload_model("m")),
    ("pb_utils.is_model_ready", lambda: pb_utils.is_model_ready("m")),
]


@pytest.mark.parametrize("installed", ["worker_runtime", "no_worker"])
@pytest.mark.parametrize(("what", "call"), OUTSIDE_EXECUTE, ids=[w for w, _ in OUTSIDE_EXECUTE])
def test_calls_outside_a_models_execute_say_so(
    installed: str, what: str, call: Callable[[], object], request: pytest.FixtureRequest
) -> None:
    """No runtime installed, or a thread no worker serves: the same error either way."""
    request.getfixturevalue(installed)
    assert link.current() is None
    with pytest.raises(pb_utils.TritonModelException) as refused:
        call()
    assert refused.value.message() == f"{what} is only available inside a model's execute()"


@pytest.mark.parametrize("installed", ["worker_runtime", "no_worker"])
def test_a_metric_value_outside_a_worker_says_so(
    installed: str, request: pytest.FixtureRequest
) -> None:
    request.getfixturevalue(installed)
    with pytest.raises(pb_utils.TritonModelException) as refused:
        pb_utils.MetricFamily("t_outside", "o", pb_utils.MetricFamily.GAUGE)
    assert refused.value.message() == (
        "Error when creating MetricFamily: custom metrics are only available in a model run "
        "by a dlserve worker"
    )


@pytest.mark.parametrize("installed", ["worker_runtime", "no_worker"])
def test_log_lines_outside_a_worker_name_no_model(
    installed: str, request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str]
) -> None:
    request.getfixturevalue(installed)
    pb_utils.Logger.log_warn("unowned")
    written = capsys.readouterr().err
    assert written.endswith("] unowned\n")
    assert "[model" not in written
