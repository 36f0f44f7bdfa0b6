"""A model's process as Triton's Python-backend stub makes it, and Triton's words for its
failures (tests/process_models, through a real server and unmodified tritonclient).

- The command line a model sees is Triton's (``sys.argv == [""]``): argparse and a unittest
  suite run inside ``initialize`` / ``execute``.
- The version folder is a package: ``model.py`` imports its siblings relatively and
  absolutely, ``__name__`` is ``"1.model"``, the folders are appended to ``sys.path``.
- Instances are named as Triton names them: ``<model>_0`` without ``instance_group``,
  ``<model>_<group>_<i>``, ``<name>_<i>`` for a named group.
- Failures in Triton's words: an exception in ``initialize`` or ``auto_complete_config``
  (pybind11's text: the exception, then ``At:`` and the frames), a process that exits or is
  killed while it initializes ("Stub process '...' is not healthy."), an exception in
  ``execute`` ("Failed to process the request(s) for model '<instance>', message: ..."),
  in a decoupled model's stream too.
- ``--exit-on-error`` is true by default, as in Triton: a model that fails to load stops
  the server at start, every failed model named with its reason.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import ROOT, RunningServer, repository_of, run_server

MODELS = ROOT / "tests" / "process_models"
FAILING = ("init_exit", "init_os_exit", "init_killed", "autocomplete_raises")
DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("process_repo")
    return repository_of(root, *sorted(MODELS.iterdir())).resolve()


@pytest.fixture(scope="module")
def server(repository: Path) -> Iterator[RunningServer]:
    with run_server(repository, "--exit-on-error", "false") as running:
        yield running


@pytest.fixture(params=["grpc", "http"])
def client(request: pytest.FixtureRequest, server: RunningServer) -> Iterator[Any]:
    if request.param == "grpc":
        with grpcclient.InferenceServerClient(server.grpc_url) as connected:
            yield connected
    else:
        connected = httpclient.InferenceServerClient(server.http_url)
        yield connected
        connected.close()


def _lib(client: Any) -> Any:
    return grpcclient if isinstance(client, grpcclient.InferenceServerClient) else httpclient


def _facts(client: Any, model: str) -> dict[str, Any]:
    tensor = _lib(client).InferInput("INPUT0", [2], "FP32")
    tensor.set_data_from_numpy(np.array([1.0, 2.0], dtype=np.float32))
    facts: dict[str, Any] = json.loads(client.infer(model, [tensor]).as_numpy("FACTS")[0])
    return facts


def _mode(lib: Any, mode: bytes) -> list[Any]:
    tensor = lib.InferInput("MODE", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([mode], dtype=np.object_))
    return [tensor]


def _at(path: Path, code: str, function: str) -> str:
    """A traceback line as pybind11 writes it: the file, the line holding ``code``."""
    lines = path.read_text().splitlines()
    number = next(i for i, line in enumerate(lines, 1) if line.strip() == code)
    return f"  {path}({number}): {function}\n"


# -- the command line and the imports ----------------------------------------------------
def test_argparse_and_unittest_inside_the_model_see_a_clean_command_line(client: Any) -> None:
    facts = _facts(client, "argv_probe")
    assert facts["argv"] == [""]  # as Triton's stub: no worker options to trip argparse
    assert facts["initialize"] == facts["execute"] == "Namespace(verbose=False)"
    assert (facts["tests_run"], facts["passed"]) == (1, True)


def test_a_model_imports_its_siblings_relatively_and_absolutely(
    client: Any, repository: Path
) -> None:
    facts = _facts(client, "siblings")
    assert (facts["name"], facts["package"]) == ("1.model", "1")
    assert facts["helper"] == "1.helper"  # from . import helper
    assert facts["absolute_helper"] == "helper"  # import helper: the version folder's
    assert facts["tools"] == "1.tools.scaling"  # a package beside it, relative inside too
    assert facts["scaled"] == [20.0, 30.0]
    # appended, as Triton's stub appends them: the model's files shadow no installed module
    version = repository / "siblings" / "1"
    assert facts["path_tail"] == [str(version), str(version.parent)]


# -- instance names ----------------------------------------------------------------------
def test_instances_are_named_as_triton_names_them(client: Any, repository: Path) -> None:
    assert sorted(os.listdir(repository / "instance_names" / "instances")) == [
        "instance_names_0_0", "instance_names_0_1", "named_0",
    ]  # fmt: skip
    if isinstance(client, grpcclient.InferenceServerClient):
        names = [g.name for g in client.get_model_config("execute_fails").config.instance_group]
    else:
        names = [g["name"] for g in client.get_model_config("execute_fails")["instance_group"]]
    assert names == ["execute_fails"]  # no instance_group: one group named after the model


# -- failures while loading ----------------------------------------------------------------
def _reasons(client: Any) -> dict[str, str]:
    if isinstance(client, grpcclient.InferenceServerClient):
        rows = client.get_model_repository_index(as_json=True).get("models", [])
    else:
        rows = client.get_model_repository_index()
    return {row["name"]: row.get("reason", "") for row in rows}


def test_load_failures_are_reported_in_tritons_words(client: Any, repository: Path) -> None:
    reasons = _reasons(client)
    init_exit = repository / "init_exit" / "1" / "model.py"
    assert reasons["init_exit"] == (  # SystemExit is an exception like any other
        "SystemExit: 3\n\nAt:\n" + _at(init_exit, "sys.exit(3)", "initialize")
    )
    assert reasons["init_os_exit"] == (
        "Stub process 'init_os_exit_0' is not healthy. Its process exited with code 3."
    )
    assert reasons["init_killed"] == (
        "Stub process 'init_killed_0' is not healthy. Its process was killed by signal 9 (SIGKILL)."
    )
    autocomplete = repository / "autocomplete_raises" / "1" / "model.py"
    raised = 'raise ValueError("autocomplete_raises: no config on purpose")'
    assert reasons["autocomplete_raises"] == (
        "ValueError: autocomplete_raises: no config on purpose\n\nAt:\n"
        + _at(autocomplete, raised, "auto_complete_config")
    )
    for model in FAILING:
        assert not client.is_model_ready(model)


# -- failures in execute -------------------------------------------------------------------
def _failure(client: Any, model: str, mode: bytes) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as info:
        client.infer(model, _mode(_lib(client), mode))
    status = info.value.status()
    assert status in ("StatusCode.INTERNAL", "500"), info.value.message()
    return info.value


def test_an_exception_in_execute_names_the_instance_and_where_it_was_raised(
    client: Any, repository: Path
) -> None:
    version = repository / "execute_fails" / "1"
    prefix = "Failed to process the request(s) for model 'execute_fails_0', message: "
    error = _failure(client, "execute_fails", b"helper")
    assert error.message() == (  # innermost first, as pybind11 walks the frames
        prefix
        + "ValueError: cannot reshape array of size 3 into shape (7,)\n\nAt:\n"
        + _at(version / "helper.py", "return np.ones(3).reshape(7)", "reshape")
        + _at(version / "helper.py", "return reshape()", "work")
        + _at(version / "model.py", "helper.work()", "execute")
    )
    error = _failure(client, "execute_fails", b"model_exception")
    raised = 'raise pb_utils.TritonModelException("execute_fails: on purpose")'
    assert error.message() == (
        prefix
        + "TritonModelException: execute_fails: on purpose\n\nAt:\n"
        + _at(version / "model.py", raised, "execute")
    )


def test_sys_exit_in_execute_fails_the_request_and_the_instance_serves_on(client: Any) -> None:
    error = _failure(client, "execute_fails", b"exit")
    assert error.message().startswith(
        "Failed to process the request(s) for model 'execute_fails_0', message: SystemExit: 4"
    )
    result = client.infer("execute_fails", _mode(_lib(client), b"fine"))
    assert result.as_numpy("OUTPUT0").tolist() == [1.0]


@pytest.mark.parametrize("mode", [b"raise", b"return"])
def test_a_decoupled_execute_that_fails_ends_its_stream_in_tritons_words(
    server: RunningServer, repository: Path, mode: bytes
) -> None:
    results: queue.Queue[tuple[Any, Any]] = queue.Queue()
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        client.async_stream_infer("stream_fails", _mode(grpcclient, mode))
        first, error = results.get(timeout=DEADLINE_S)
        assert error is None and first.as_numpy("OUTPUT0").tolist() == [1.0]
        _, error = results.get(timeout=DEADLINE_S)
        client.stop_stream()
    prefix = "Failed to process the request(s) for model 'stream_fails_0', message: "
    if mode == b"raise":
        model = repository / "stream_fails" / "1" / "model.py"
        expected = "ValueError: stream_fails: on purpose\n\nAt:\n" + _at(
            model, 'raise ValueError("stream_fails: on purpose")', "execute"
        )
    else:
        expected = ("Python model 'stream_fails_0' is using the decoupled mode and the "
                    "execute function must return None.")  # fmt: skip
    assert error.message() == prefix + expected


# -- --exit-on-error -----------------------------------------------------------------------
def test_by_default_a_model_that_fails_to_load_stops_the_server(tmp_path: Path) -> None:
    """As Triton's --exit-on-error=true: exit status 1 before anything is served, every
    failed model named with its reason, the good model not among them."""
    failing = [MODELS / name for name in ("init_exit", "autocomplete_raises")]
    repository = repository_of(tmp_path, MODELS / "argv_probe", *failing)
    command = [sys.executable, "-m", "dlserve", "serve", "--model-repository", str(repository),
               "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    said = done.stderr.split("failed to load all models (--exit-on-error): ")[1]
    assert "init_exit: SystemExit: 3" in said
    assert "autocomplete_raises: ValueError: autocomplete_raises: no config on purpose" in said
    assert "argv_probe" not in said
    assert "Started GRPCInferenceService" not in done.stdout
