"""The SDK and the CUDA shared-memory lifecycle on a GPU (run on the device machine).

- one-call inference with torch and cupy CUDA inputs; outputs on the GPU as DLPack tensors;
- 8 threads at once; the CUDA pool reused (the server's CUDA region count flat over 1,000
  calls);
- cuda_shared_memory: the drop-in calls, set_shared_memory_by_cuda_array, a region as a
  context manager frees its memory;
- crash: a client registers a 1 GiB CUDA region (a worker opens it) and is SIGKILLed:
  within 5 s the status lists none of it and the device's free memory is back;
- the zero-copy guide's client, with only its import changed (and its misnamed keyword),
  against the guide's model.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from conftest import EXAMPLES, TEST_MODELS, RunningServer, run_server
from dlserve.client import Client, DeviceArray
from dlserve.client import cuda_shared_memory as cudashm

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]
HERE = Path(__file__).parent
GIB = 1 << 30
SLACK = 64 << 20  # free memory may differ by allocator caches of living processes
IMAGE = (1, 3, 224, 224)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    repository = tmp_path_factory.mktemp("gpu_repo")
    for model in ("add_sub", "double"):
        shutil.copytree(EXAMPLES / model, repository / model)
    shutil.copytree(TEST_MODELS / "your_python_model", repository / "your_python_model")
    with run_server(repository) as running:
        yield running


def cuda_regions(server: RunningServer) -> set[str]:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        return set(client.get_cuda_shared_memory_status().regions)
    finally:
        client.close()


def wait_until(done: Callable[[], bool], deadline_s: float = 5.0) -> float:
    start = time.monotonic()
    while not done():
        assert time.monotonic() - start < deadline_s, f"not done within {deadline_s} s"
        time.sleep(0.02)  # polling an observable that has no event
    return time.monotonic() - start


def free_memory(device: int = 0) -> int:
    free, _ = torch.cuda.mem_get_info(device)
    return int(free)


def test_torch_cuda_inputs_and_gpu_outputs(server: RunningServer) -> None:
    image = torch.randn(IMAGE, device="cuda:0")
    with Client(server.grpc_url) as client:
        out = client.infer("double", {"INPUT_0": image})
        np.testing.assert_allclose(out["OUTPUT_0"], (image * 2).cpu().numpy())
        on_gpu = client.infer("double", {"INPUT_0": image}, {"OUTPUT_0": "cuda:0"})
        assert isinstance(on_gpu["OUTPUT_0"], DeviceArray)
        tensor = torch.from_dlpack(on_gpu["OUTPUT_0"])
        assert tensor.is_cuda and torch.equal(tensor, image * 2)
        # the first call's 1 MiB region holds the input; the second needs room for the
        # output too (written there by the worker, device to device): a 2 MiB one
        assert len(cuda_regions(server)) == 2
        for _ in range(10):
            client.infer("double", {"INPUT_0": image}, {"OUTPUT_0": "cuda:0"})
        assert len(cuda_regions(server)) == 2  # reused
    assert cuda_regions(server) == set()


def test_cupy_inputs(server: RunningServer) -> None:
    cupy = pytest.importorskip("cupy")
    a = cupy.arange(50_000, dtype=cupy.float32)
    b = cupy.ones(50_000, dtype=cupy.float32)
    with Client(server.grpc_url) as client:
        out = client.infer("add_sub", {"INPUT0": a, "INPUT1": b}, {"OUTPUT0": "cuda:0"})
        np.testing.assert_array_equal(cupy.from_dlpack(out["OUTPUT0"]).get(), (a + b).get())


def test_eight_threads_on_the_gpu(server: RunningServer) -> None:
    errors: list[BaseException] = []
    with Client(server.grpc_url) as client:

        def work(seed: int) -> None:
            generator = torch.Generator(device="cuda").manual_seed(seed)
            try:
                for _ in range(25):
                    image = torch.randn(IMAGE, device="cuda", generator=generator)
                    out = client.infer("double", {"INPUT_0": image})
                    np.testing.assert_allclose(out["OUTPUT_0"], (image * 2).cpu().numpy())
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(seed,)) for seed in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
        assert 1 <= len(cuda_regions(server)) <= 8


def test_the_cuda_pool_is_reused_over_1000_calls(server: RunningServer) -> None:
    image = torch.randn(IMAGE, device="cuda:0")
    counts = []
    with Client(server.grpc_url) as client:
        for call in range(1000):
            client.infer("double", {"INPUT_0": image})
            if call % 100 == 0:
                counts.append(len(cuda_regions(server)))
    assert counts == [1] * 10


def test_cuda_shared_memory_drop_in() -> None:
    import tritonclient.utils.cuda_shared_memory as triton_cudashm

    before = free_memory()
    with cudashm.create_shared_memory_region("r", 64 << 20, 0) as region:
        assert free_memory() <= before - (64 << 20)
        values = np.arange(16, dtype=np.float32)
        cudashm.set_shared_memory_region(region, [values])
        np.testing.assert_array_equal(
            cudashm.get_contents_as_numpy(region, np.float32, [16]), values
        )
        source = torch.arange(8, dtype=torch.float32, device="cuda") * 3
        cudashm.set_shared_memory_by_cuda_array(region, source.data_ptr(), 32)
        np.testing.assert_array_equal(
            cudashm.get_contents_as_numpy(region, np.float32, [8]), source.cpu().numpy()
        )
        cudashm.set_shared_memory_region_from_dlpack(region, [source + 1])
        view = torch.from_dlpack(cudashm.as_shared_memory_tensor(region, "FP32", [8]))
        assert torch.equal(view, source + 1)
        assert cudashm.get_raw_handle(region) == triton_cudashm.get_raw_handle(region)
        assert region in cudashm.allocated_shared_memory_regions()
        del view
    assert region not in cudashm.allocated_shared_memory_regions()
    assert free_memory() >= before - SLACK


OWNER = textwrap.dedent(
    """
    import sys
    import numpy as np
    import tritonclient.grpc as grpcclient
    from dlserve.client import cuda_shared_memory as cudashm

    client = grpcclient.InferenceServerClient(sys.argv[1])
    region = cudashm.create_shared_memory_region("big", 1 << 30, 0)
    image = np.ones((1, 3, 224, 224), dtype=np.float32)
    cudashm.set_shared_memory_region(region, [image])
    client.register_cuda_shared_memory("big", cudashm.get_raw_handle(region), 0, 1 << 30)
    tensor = grpcclient.InferInput("INPUT_0", list(image.shape), "FP32")
    tensor.set_shared_memory("big", image.nbytes)  # the GPU worker opens the region's handle
    assert (client.infer("double", [tensor]).as_numpy("OUTPUT_0") == 2).all()
    print("registered", flush=True)
    sys.stdin.read()
    """
)


def test_a_killed_clients_1gib_cuda_region_is_freed(server: RunningServer) -> None:
    # Warm up: the server's CUDA context (made by its first CUDA registration) and the
    # worker's stay; only what the owner adds must go.
    with Client(server.grpc_url) as client:
        client.infer("double", {"INPUT_0": torch.randn(IMAGE, device="cuda:0")})
    baseline = free_memory()
    with subprocess.Popen(
        [sys.executable, "-c", OWNER, server.grpc_url],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    ) as owner:  # fmt: skip
        assert owner.stdout is not None
        assert owner.stdout.readline().strip() == "registered"
        assert "big" in cuda_regions(server)
        assert free_memory() < baseline - GIB
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    gone = wait_until(lambda: "big" not in cuda_regions(server))
    freed = wait_until(lambda: free_memory() >= baseline - SLACK)
    print(f"1 GiB region: gone from status {gone:.3f} s, memory back {freed:.3f} s later")


def test_the_guide_client_with_only_its_import_changed(server: RunningServer) -> None:
    source = (HERE / "guide_client.py").read_text().replace("localhost:8001", server.grpc_url)
    done = subprocess.run(
        [sys.executable, "-c", source], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "Inference completed successfully!" in done.stdout
    assert "OUTPUT_0 == 2 * INPUT_0" in done.stdout
    assert cuda_regions(server) == set()
