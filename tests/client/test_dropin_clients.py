"""dlserve.client.grpc / .http: tritonclient's clients, taking a published zero-copy guide's
`cuda_shm_handle=`."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from types import ModuleType

import pytest
import tritonclient.grpc
import tritonclient.http
from tritonclient.utils import InferenceServerException

import dlserve.client.grpc
import dlserve.client.http
from conftest import EXAMPLES, RunningServer, run_server

HANDLE = base64.b64encode(b"\7" * 64)  # well formed, names no memory


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with run_server(EXAMPLES) as running:
        yield running


@pytest.mark.parametrize("module", [dlserve.client.grpc, dlserve.client.http])
def test_the_drop_ins_are_tritonclients(server: RunningServer, module: ModuleType) -> None:
    url = server.grpc_url if module is dlserve.client.grpc else server.http_url
    triton = tritonclient.grpc if module is dlserve.client.grpc else tritonclient.http
    assert module.InferInput is triton.InferInput
    with module.InferenceServerClient(url) as client:
        assert client.is_server_ready()
        # The guide's spelling reaches the server: its answer is about the handle, not a
        # TypeError (this handle opens nowhere, and CI has no GPU).
        with pytest.raises(InferenceServerException) as info:
            client.register_cuda_shared_memory(
                name="seed", cuda_shm_handle=HANDLE, device_id=0, byte_size=64
            )
        # Triton's refusal: the handle does not open, or (no cuda-python) no GPU support
        assert info.value.message().startswith(
            ("failed to register shared memory region", "failed to register CUDA shared memory")
        )
        with pytest.raises(TypeError, match="takes the handle once"):
            client.register_cuda_shared_memory("seed", HANDLE, 0, 64, cuda_shm_handle=HANDLE)
        status = client.get_cuda_shared_memory_status()
        assert (len(status.regions) if module is dlserve.client.grpc else len(status)) == 0
