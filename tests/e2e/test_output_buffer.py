"""pb_utils.get_output_buffer on the host: the model writes its output where it must end up.

Over the wire (large enough to go through the worker's output arena, 1.2 GB through a
256 MiB arena over 300 requests) and into a client's system shared-memory region at an
offset; a region too small for the output is refused, and the instance goes on serving.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.utils.shared_memory as shm

from conftest import TEST_MODELS, RunningServer, repository_of, run_server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    root = tmp_path_factory.mktemp("output_buffer_repo")
    with run_server(repository_of(root, TEST_MODELS / "output_buffer")) as running:
        yield running


def _input(data: np.ndarray) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput("INPUT0", list(data.shape), "FP32")
    tensor.set_data_from_numpy(data)
    return tensor


def test_outputs_on_the_wire_written_in_place(server: RunningServer) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    n = 1 << 20  # 4 MiB a request: 300 requests pass 1.2 GB through a 256 MiB arena
    for i in range(300):
        data = np.full(n, i, np.float32)
        result = client.infer("output_buffer", [_input(data)])
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), data * 2)
    params = result.get_response().parameters
    assert params["writable"].bool_param and params["is_cpu"].bool_param
    client.close()


def test_an_output_written_into_the_clients_region(server: RunningServer) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    key = f"/outbuf_{uuid.uuid4().hex}"
    handle = shm.create_shared_memory_region(key, key, 4096)
    try:
        client.register_system_shared_memory("out", key, 4096)
        data = np.arange(16, dtype=np.float32)
        output = grpcclient.InferRequestedOutput("OUTPUT0")
        output.set_shared_memory("out", 64, offset=100)  # not page- or float-aligned
        client.infer("output_buffer", [_input(data)], outputs=[output])
        got = shm.get_contents_as_numpy(handle, np.float32, [16], offset=100)
        np.testing.assert_array_equal(got, data * 2)
    finally:
        client.unregister_system_shared_memory()
        shm.destroy_shared_memory_region(handle)
        client.close()


def test_an_output_region_too_small_is_refused(server: RunningServer) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    key = f"/outbuf_{uuid.uuid4().hex}"
    handle = shm.create_shared_memory_region(key, key, 64)
    try:
        client.register_system_shared_memory("small", key, 64)
        output = grpcclient.InferRequestedOutput("OUTPUT0")
        output.set_shared_memory("small", 32)
        with pytest.raises(Exception, match="should be at least 64 bytes"):
            client.infer("output_buffer", [_input(np.ones(16, np.float32))], outputs=[output])
        # the instance still serves
        result = client.infer("output_buffer", [_input(np.ones(4, np.float32))])
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), np.full(4, 2, np.float32))
    finally:
        client.unregister_system_shared_memory()
        shm.destroy_shared_memory_region(handle)
        client.close()
