"""BLS with CUDA tensors (run on the GPU machine): tensors pass between models by CUDA IPC
handle, both ways, and a callee that writes into its input writes into the caller's
GPU memory."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from conftest import TEST_MODELS, RunningServer, run_server

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    repository = tmp_path_factory.mktemp("bls_gpu_repo")
    for name in ("gpu_ops", "bls_gpu"):
        shutil.copytree(TEST_MODELS / name, repository / name)
    with run_server(repository) as running:
        yield running


def infer(server: RunningServer, mode: str, x: np.ndarray) -> grpcclient.InferResult:
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        tensor = grpcclient.InferInput("INPUT0", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        return client.infer("bls_gpu", [tensor], parameters={"mode": mode})


@pytest.mark.parametrize("size", [4, 1_000_000])
def test_gpu_pipeline_keeps_tensors_on_the_gpu(server: RunningServer, size: int) -> None:
    x = np.linspace(-1, 1, size, dtype=np.float32)
    for _ in range(3):  # lent GPU outputs are given back and the handles stay open
        result = infer(server, "pipeline", x)
        np.testing.assert_allclose(result.as_numpy("OUTPUT0"), x * 2 + 1)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), [1.0])


def test_gpu_zero_copy_between_models(server: RunningServer) -> None:
    x = np.arange(1000, dtype=np.float32)
    np.testing.assert_array_equal(infer(server, "in_place", x).as_numpy("OUTPUT0"), x + 1)
