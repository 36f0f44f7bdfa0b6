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


@pytest.fixture(scope="module", params=["direct", "through_server"])
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    """BLS calls straight to the callee's worker, and (--bls-direct false) through the
    server: GPU tensors are lent and given back either way."""
    repository = tmp_path_factory.mktemp("bls_gpu_repo")
    for name in ("bls_gpu_ops", "bls_gpu"):
        shutil.copytree(TEST_MODELS / name, repository / name)
    shutil.copytree(TEST_MODELS / "bls_gpu_ops", repository / "bls_gpu_ops_b")  # 2nd process
    direct = "true" if request.param == "direct" else "false"
    with run_server(repository, "--bls-direct", direct) as running:
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


def test_gpu_give_back_waits_for_the_callers_work(server: RunningServer) -> None:
    """A lent GPU output is summed behind a long GPU sleep, then dropped, and the callee is
    called again at once: the give-back must wait for the caller's queued work, or the
    callee's next tensors overwrite the memory before the sum reads it."""
    x = np.linspace(0, 1, 1_000_000, dtype=np.float32)
    for _ in range(2):
        total = infer(server, "give_back", x).as_numpy("OUTPUT0")
        np.testing.assert_allclose(total, [2 * x.sum(dtype=np.float64)], rtol=1e-4)


def test_gpu_zero_copy_between_models(server: RunningServer) -> None:
    x = np.arange(1000, dtype=np.float32)
    np.testing.assert_array_equal(infer(server, "in_place", x).as_numpy("OUTPUT0"), x + 1)


def test_gpu_answer_waits_for_the_callees_work_on_its_input(server: RunningServer) -> None:
    """The callee adds 1 to the caller's tensor behind a long GPU sleep and answers with a
    host tensor: its answer must wait for that work, or the caller reads x, not x + 1."""
    x = np.arange(1000, dtype=np.float32)
    for _ in range(2):  # a process's first kernel launch loads the module and waits
        got = infer(server, "in_place_late", x).as_numpy("OUTPUT0")
        np.testing.assert_array_equal(got, x + 1)


def test_gpu_output_passed_on_before_its_work_is_done(server: RunningServer) -> None:
    """The first callee answers with a GPU tensor whose kernel is queued behind a long GPU
    sleep; the caller passes it at once to a callee in another process. Its reader must
    come after that work (direct calls send fences instead of waiting), or it reads
    what the memory held before. Each round's input differs: from the second round on the
    callee's output memory (and the handles to it) is the previous round's."""
    for round_ in range(3):
        x = np.linspace(-1, 1, 100_000, dtype=np.float32) + round_
        got = infer(server, "late_pipeline", x).as_numpy("OUTPUT0")
        np.testing.assert_allclose(got, x * 2 + 1)


def test_gpu_output_read_on_a_stream_of_the_callers(server: RunningServer) -> None:
    """The callee's late GPU output is read on a torch stream of the caller's own (a
    non-blocking one): DLPack's ``__dlpack__(stream)`` must order that stream after the
    callee's work. Each round's input differs, as above."""
    for round_ in range(3):
        x = np.linspace(-1, 1, 100_000, dtype=np.float32) + round_
        got = infer(server, "late_side_stream", x).as_numpy("OUTPUT0")
        np.testing.assert_allclose(got, x * 2)


def test_gpu_zero_copy_from_a_client_cuda_region(server: RunningServer) -> None:
    """The client's input is in its CUDA shared memory; bls_gpu passes it on (by the
    client's handle) to bls_gpu_ops, which adds 1 to it in place: the client's own GPU
    memory changes."""
    import tritonclient.utils.cuda_shared_memory as cudashm

    x = np.arange(4096, dtype=np.float32)
    region = cudashm.create_shared_memory_region("bls_gpu_in", x.nbytes, 0)
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        try:
            cudashm.set_shared_memory_region(region, [x])
            client.register_cuda_shared_memory("bls_gpu_in", cudashm.get_raw_handle(region), 0,
                                               x.nbytes)  # fmt: skip
            tensor = grpcclient.InferInput("INPUT0", [x.size], "FP32")
            tensor.set_shared_memory("bls_gpu_in", x.nbytes)
            result = client.infer("bls_gpu", [tensor], parameters={"mode": "in_place"})
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x + 1)
            mine = cudashm.get_contents_as_numpy(region, np.float32, [x.size])
            np.testing.assert_array_equal(mine, x + 1)  # the client's own GPU memory
        finally:
            client.unregister_cuda_shared_memory("bls_gpu_in")
            cudashm.destroy_shared_memory_region(region)
