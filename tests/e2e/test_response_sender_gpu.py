"""The response sender of a model that is not decoupled, with GPU outputs (run on the GPU
machine): a GPU tensor sent from the model's thread after ``execute`` returned reaches a
gRPC client, and a BLS caller (straight to the callee's instance, and through the server),
which gets it lent by CUDA IPC handle."""

from __future__ import annotations

import concurrent.futures
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from conftest import TEST_MODELS, FifoGate, RunningServer, run_server

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]

MODEL = "gpu_default_sender"
TIMEOUT_S = 60


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    repository = tmp_path_factory.mktemp("gpu_sender_repo")
    for name in (MODEL, "sender_relay"):
        shutil.copytree(TEST_MODELS / name, repository / name)
    with run_server(repository) as running:
        yield running


def infer(server: RunningServer, model: str, value: int, **params: str) -> int:
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        tensor = grpcclient.InferInput("IN", [1], "INT32")
        tensor.set_data_from_numpy(np.array([value], np.int32))
        result = client.infer(model, [tensor], parameters=params, client_timeout=TIMEOUT_S)
        return int(result.as_numpy("OUT")[0])


@pytest.mark.parametrize(
    ("model", "params"),
    [
        pytest.param(MODEL, {}, id="client"),
        pytest.param("sender_relay", {"callee": MODEL, "through": "direct"}, id="bls-direct"),
        pytest.param("sender_relay", {"callee": MODEL, "through": "server"}, id="bls-server"),
    ],
)
def test_gpu_response_sent_after_execute_returned(
    server: RunningServer, tmp_path: Path, model: str, params: dict[str, str]
) -> None:
    gate = FifoGate(tmp_path)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(infer, server, model, 4, mode="later", gate=str(gate.go), **params)
        assert infer(server, MODEL, 5, mode="return") == 53  # the first execute returned
        gate.open()
        assert waiting.result(TIMEOUT_S) == 41
