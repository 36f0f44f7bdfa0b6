"""A BLS callee's reply that cannot be read, when its output is GPU memory lent to the
caller by IPC handle (run on the GPU machine): the call fails with an error naming the
callee, the lent output goes back to the callee, and the same instances serve on, with
the call straight to the callee's instance and through the server."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from conftest import TEST_MODELS, RunningServer, repository_of, run_server

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]


@pytest.fixture(scope="module", params=["true", "false"], ids=["direct", "through-server"])
def server(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[RunningServer]:
    models = (TEST_MODELS / name for name in ("bad_frame", "bad_callee", "bad_gpu_callee"))
    repository = repository_of(tmp_path_factory.mktemp("names_gpu_repo"), *models)
    with run_server(repository, "--bls-direct", request.param) as running:
        yield running


def bad_frame(server: RunningServer, mode: str, size: int) -> tuple[list[int], str]:
    """bad_frame's (pids of itself and bad_gpu_callee, error text); none of either's
    output memory (arena pieces, lent GPU outputs) held when their executes began."""
    x = np.arange(size, dtype=np.float32)
    tensor = grpcclient.InferInput("INPUT0", [size], "FP32")
    tensor.set_data_from_numpy(x)
    params = {"mode": mode, "callee": "bad_gpu_callee"}
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        result = client.infer("bad_frame", [tensor], parameters=params)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x)
    assert result.as_numpy("HELD").tolist() == [0, 0]
    return result.as_numpy("PIDS").tolist(), result.as_numpy("ERROR")[0].decode()


@pytest.mark.parametrize("size", [4, 1_000_000])
def test_an_unreadable_reply_with_a_lent_gpu_output(server: RunningServer, size: int) -> None:
    pids, _ = bad_frame(server, "ok", size)
    after, error = bad_frame(server, "direct_reply", size)
    assert after == pids
    assert error.startswith(
        "model 'bad_gpu_callee' (instance 'bad_gpu_callee_0_0') sent a frame (InferDone) that "
        "cannot be read: Expected `str`, got `bytes`"
    ), error
    assert bad_frame(server, "ok", size) == (pids, "")
