"""dlserve.client.shared_memory behaves as tritonclient.utils.shared_memory: the same calls
run against both modules and must give the same results; a region registered from ours
serves a real server. Ours adds regions as context managers."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.utils.shared_memory as triton_shm
from tritonclient.utils import serialize_byte_tensor

from conftest import EXAMPLES, RunningServer, run_server
from dlserve.client import shared_memory as dlserve_shm


@pytest.fixture(params=[triton_shm, dlserve_shm], ids=["tritonclient", "dlserve"])
def shm(request: pytest.FixtureRequest) -> ModuleType:
    module: ModuleType = request.param
    return module


@pytest.fixture
def key() -> Iterator[str]:
    name = f"shmdrop_{uuid.uuid4().hex}"
    yield "/" + name
    Path(f"/dev/shm/{name}").unlink(missing_ok=True)


def test_set_get_destroy(shm: ModuleType, key: str) -> None:
    handle = shm.create_shared_memory_region("r", key, 256)
    assert key in shm.mapped_shared_memory_regions()
    a = np.arange(16, dtype=np.float32)
    b = np.arange(8, dtype=np.int64)
    shm.set_shared_memory_region(handle, [a, b])  # one after the other
    np.testing.assert_array_equal(shm.get_contents_as_numpy(handle, np.float32, [16]), a)
    np.testing.assert_array_equal(shm.get_contents_as_numpy(handle, np.int64, [8], 64), b)
    strings = serialize_byte_tensor(np.array([b"ab", b"", b"cde"], dtype=object))
    shm.set_shared_memory_region(handle, [strings], offset=128)
    got = shm.get_contents_as_numpy(handle, np.object_, [3], offset=128)
    assert got.tolist() == [b"ab", b"", b"cde"]
    with pytest.raises(shm.SharedMemoryException):
        shm.set_shared_memory_region(handle, a)  # not a list
    with pytest.raises(shm.SharedMemoryException):
        shm.set_shared_memory_region(handle, [a.tolist()])  # not arrays
    shm.destroy_shared_memory_region(handle)
    assert key not in shm.mapped_shared_memory_regions()
    assert not Path(f"/dev/shm{key}").exists()


def test_an_existing_object_is_shared_unless_create_only(shm: ModuleType, key: str) -> None:
    first = shm.create_shared_memory_region("a", key, 64)
    with pytest.warns(UserWarning, match="region size is 64 instead of requested 128"):
        second = shm.create_shared_memory_region("b", key, 128)
    shm.set_shared_memory_region(first, [np.full(16, 7, dtype=np.int32)])
    np.testing.assert_array_equal(shm.get_contents_as_numpy(second, np.int32, [16]), 7)
    with pytest.raises(shm.SharedMemoryException):
        shm.create_shared_memory_region("c", key, 64, create_only=True)
    shm.destroy_shared_memory_region(second)
    assert Path(f"/dev/shm{key}").exists()  # a handle is left
    shm.destroy_shared_memory_region(first)
    assert not Path(f"/dev/shm{key}").exists()  # the last one unlinks


def test_regions_are_context_managers(key: str) -> None:
    with (
        pytest.raises(RuntimeError, match="boom"),
        dlserve_shm.create_shared_memory_region("r", key, 64) as handle,
    ):
        assert handle.byte_size == 64 and handle.key == key and handle.name == "r"
        raise RuntimeError("boom")
    assert not Path(f"/dev/shm{key}").exists()
    assert key not in dlserve_shm.mapped_shared_memory_regions()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    repository = tmp_path_factory.mktemp("drop_in_repo")
    shutil.copytree(EXAMPLES / "add_sub", repository / "add_sub")
    with run_server(repository) as running:
        yield running


def test_tritonclient_code_with_our_module(server: RunningServer, key: str) -> None:
    """tritonclient's system shared memory example, with only the import changed."""
    shm = dlserve_shm
    client = grpcclient.InferenceServerClient(server.grpc_url)
    a, b = np.arange(16, dtype=np.float32), np.ones(16, dtype=np.float32)
    with shm.create_shared_memory_region("io", key, 128) as handle:
        shm.set_shared_memory_region(handle, [a, b])
        client.register_system_shared_memory("io", key, 128)
        inputs = [grpcclient.InferInput(n, [16], "FP32") for n in ("INPUT0", "INPUT1")]
        inputs[0].set_shared_memory("io", 64)
        inputs[1].set_shared_memory("io", 64, offset=64)
        outputs = [grpcclient.InferRequestedOutput("OUTPUT0")]
        outputs[0].set_shared_memory("io", 64)  # over INPUT0, as Triton allows
        client.infer("add_sub", inputs, outputs=outputs)
        np.testing.assert_array_equal(shm.get_contents_as_numpy(handle, np.float32, [16]), a + b)
        client.unregister_system_shared_memory("io")
    client.close()
