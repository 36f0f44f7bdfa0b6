"""``--model-control-mode poll``: the server follows its repository (models added, changed,
removed), as Triton does in POLL mode. Changes are seen on a timer, so the tests ask the
server's own status calls until it shows them, with a deadline."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from conftest import TEST_MODELS, RunningServer, run_server

DEADLINE_S = 30.0
TIMES_TWO = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            data = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", 2 * data)]))
        return responses
"""


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    root.mkdir()
    shutil.copytree(TEST_MODELS / "plain", root / "plain")
    return root


@pytest.fixture
def server(repository: Path) -> Iterator[RunningServer]:
    with run_server(
        repository, "--model-control-mode", "poll", "--repository-poll-secs", "0.2"
    ) as s:
        yield s


@pytest.fixture
def client(server: RunningServer) -> Iterator[grpcclient.InferenceServerClient]:
    with grpcclient.InferenceServerClient(server.grpc_url) as c:
        yield c


def until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"not seen within {DEADLINE_S} s: {what}"


def plain(client: grpcclient.InferenceServerClient, model: str = "plain") -> list[float]:
    tensor = grpcclient.InferInput("INPUT0", [2], "FP32")
    tensor.set_data_from_numpy(np.array([1.5, 2.0], dtype=np.float32))
    values: list[float] = client.infer(model, [tensor]).as_numpy("OUTPUT0").tolist()
    return values


def place(model: Path, repository: Path, name: str) -> None:
    """Put a model folder into the repository in one step (a rename), as POLL mode wants."""
    staging = repository.parent / f".staging_{name}"
    shutil.copytree(model, staging)
    staging.rename(repository / name)


def test_explicit_load_and_unload_are_refused(client: grpcclient.InferenceServerClient) -> None:
    for call in (client.load_model, client.unload_model):
        with pytest.raises(InferenceServerException) as raised:
            call("plain")
        assert "explicit model load / unload is not allowed if polling is enabled" in str(
            raised.value.message()
        )
    assert client.is_model_ready("plain")


def test_models_added_changed_and_removed(
    client: grpcclient.InferenceServerClient, repository: Path
) -> None:
    assert plain(client) == [1.5, 2.0]

    place(TEST_MODELS / "plain", repository, "copy")
    until(lambda: client.is_model_ready("copy"), "the added model loaded")
    assert plain(client, "copy") == [1.5, 2.0]

    # a changed model.py: the model is reloaded, and serves all along (no request fails)
    staged = repository.parent / "model.py"
    staged.write_text(TIMES_TWO)
    staged.rename(repository / "plain" / "1" / "model.py")
    until(lambda: plain(client) == [3.0, 4.0], "the changed model reloaded")

    shutil.rmtree(repository / "copy")
    until(lambda: not client.is_model_ready("copy"), "the removed model unloaded")
    with pytest.raises(InferenceServerException):
        plain(client, "copy")


def test_a_change_that_cannot_load_leaves_the_model_serving(
    client: grpcclient.InferenceServerClient, repository: Path
) -> None:
    """A broken config: the loaded model serves on (a poll loads changed models one at a
    time in name order, so once 'zz_marker' is ready the broken reload was tried); fixed,
    the new version loads."""
    config = repository / "plain" / "config.pbtxt"
    good = config.read_text()
    staged = repository.parent / "config.pbtxt"
    staged.write_text(good.replace("max_batch_size: 0", "max_batch_size: -3"))
    staged.rename(config)
    place(TEST_MODELS / "plain", repository, "zz_marker")
    until(lambda: client.is_model_ready("zz_marker"), "the poll that tried the broken config")
    assert client.is_model_ready("plain")
    index = {m.name: m.state for m in client.get_model_repository_index().models}
    assert index["plain"] == "READY"
    assert plain(client) == [1.5, 2.0]

    model = repository.parent / "model.py"
    model.write_text(TIMES_TWO)
    model.rename(repository / "plain" / "1" / "model.py")
    staged.write_text(good)
    staged.rename(config)
    until(lambda: plain(client) == [3.0, 4.0], "the fixed model loaded")


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_a_poll_interval_that_is_not_positive_is_refused(value: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "dlserve", "serve", "--model-repository", str(TEST_MODELS),
         "--model-control-mode", "poll", "--repository-poll-secs", value],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert "--repository-poll-secs: must be > 0" in done.stderr
