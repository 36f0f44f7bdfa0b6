"""CUDA shared memory through a real server, driven by unmodified tritonclient
(``tritonclient.utils.cuda_shared_memory`` for the regions), over gRPC and HTTP.

Without a GPU (CI): the status and unregister calls, malformed handles, a missing name or
field, names shared with system shared memory, and a registration that cannot work here, each
with Triton's code and message.
On a GPU (``gpu`` marker): register / status / unregister; inputs and outputs in regions at
offsets; the model writing into the client's memory; torch and cupy models; GPU outputs on
the wire; as_numpy of a GPU input; input placement (as arrived, FORCE_CPU_ONLY_INPUT_TENSORS,
force_gpu_tensors); a producer deleted right after from_dlpack; get_output_buffer; the
instance's device bound before initialize; unregistering while a request is in flight; each
refused registration, and offsets past a region, with Triton's message; the zero-copy guide's model
and config, unchanged.
"""

from __future__ import annotations

import base64
import json
import os
import queue
import shutil
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import EXAMPLES, TEST_MODELS, RunningServer, run_server
from dlserve.tensors import cuda_ipc

try:
    import tritonclient.utils.cuda_shared_memory as cudashm
except (ImportError, RuntimeError):  # needs cuda-python
    cudashm = None

HAS_GPU = cudashm is not None and cuda_ipc.available()
gpu = [pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="no CUDA device")]
# Triton 2.51's messages (src/shared_memory_manager.cc, src/http_server.cc, src/grpc/); dlserve
# says the same, then, where Triton only logs it, why.
TRITON = {
    "bad_handle": "'raw_handle' must be a valid base64 encoded cudaIpcMemHandle_t",
    "open_failed": "failed to register shared memory region: invalid args",
    "size_refused": "failed to register shared memory region '{}': invalid args",
    "not_supported": "failed to register CUDA shared memory region: '{}', GPUs not supported",
    "exists": "shared memory region '{}' already in manager",
    "bad_offset": "Invalid offset for shared memory region: '{}'",
    "bad_span": "Invalid offset + byte size for shared memory region: '{}'",
}
DEADLINE_S = 60.0
FLOAT = 4
STATUS = {  # code -> (gRPC status, HTTP status)
    "INVALID_ARG": ("INVALID_ARGUMENT", "400"),
    "NOT_FOUND": ("NOT_FOUND", "404"),
    "ALREADY_EXISTS": ("ALREADY_EXISTS", "400"),
    "UNSUPPORTED": ("UNIMPLEMENTED", "501"),
}
PLACEMENTS = {  # model name -> the config parameter its copy of gpu_ops sets
    "gpu_ops_cpu": ("FORCE_CPU_ONLY_INPUT_TENSORS", "yes"),
    "gpu_ops_gpu": ("force_gpu_tensors", "True"),
}


def _repository(root: Path) -> Path:
    for source in (EXAMPLES / "add_sub", TEST_MODELS / "gated", TEST_MODELS / "gpu_ops",
                   TEST_MODELS / "gpu_stream_late", TEST_MODELS / "your_python_model"):  # fmt: skip
        shutil.copytree(source, root / source.name)
    for name, (key, value) in PLACEMENTS.items():
        shutil.copytree(TEST_MODELS / "gpu_ops", root / name)
        config = root / name / "config.pbtxt"
        parameter = f'parameters: {{ key: "{key}" value: {{ string_value: "{value}" }} }}\n'
        config.write_text(config.read_text() + parameter)
    return root


@pytest.fixture(scope="module")
def cuda_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    repository = _repository(tmp_path_factory.mktemp("cuda_repo"))
    # without a GPU the KIND_GPU models cannot load: the registration tests run all the same
    with run_server(repository, "--exit-on-error", "false") as server:
        yield server


@dataclass
class Client:
    protocol: str
    lib: Any
    api: Any

    def fails(self, code: str, call: Callable[..., Any], *args: Any) -> str:
        with pytest.raises(InferenceServerException) as info:
            call(*args)
        grpc_status, http_status = STATUS[code]
        expected = f"StatusCode.{grpc_status}" if self.protocol == "grpc" else http_status
        assert str(info.value.status()) == expected, info.value.message()
        return str(info.value.message())

    def status(self, name: str = "") -> dict[str, tuple[int, int]]:
        got = self.api.get_cuda_shared_memory_status(name)
        if self.protocol == "grpc":
            return {n: (r.device_id, r.byte_size) for n, r in got.regions.items()}
        return {r["name"]: (r["device_id"], r["byte_size"]) for r in got}

    def register(self, name: str, region: Any, byte_size: int, device: int = 0) -> None:
        self.api.register_cuda_shared_memory(name, cudashm.get_raw_handle(region), device,
                                             byte_size)  # fmt: skip

    def in_region(self, name: str, shape: list[int], region: str, at: int = 0) -> Any:
        size = int(np.prod(shape)) * FLOAT
        return self.lib.InferInput(name, shape, "FP32").set_shared_memory(region, size, offset=at)

    def wire(self, name: str, array: Any, datatype: str = "FP32") -> Any:
        tensor = self.lib.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        return tensor

    def output(self, name: str, region: str | None = None, size: int = 0, at: int = 0) -> Any:
        output = self.lib.InferRequestedOutput(name)
        if region is not None:
            output.set_shared_memory(region, size, offset=at)
        return output

    def infer(self, model: str, inputs: list[Any], outputs: list[Any], op: str = "double",
              ) -> tuple[Any, dict[str, Any]]:  # fmt: skip
        """The result, and the response's parameters as plain values."""
        result = self.api.infer(model, inputs, outputs=outputs, parameters={"op": op})
        response = result.get_response()
        if self.protocol == "http":
            return result, dict(response.get("parameters", {}))
        params = {}
        for key, value in response.parameters.items():
            params[key] = getattr(value, value.WhichOneof("parameter_choice"))
        return result, params


def connect(protocol: str, server: RunningServer) -> Client:
    if protocol == "grpc":
        return Client("grpc", grpcclient, grpcclient.InferenceServerClient(server.grpc_url))
    return Client("http", httpclient, httpclient.InferenceServerClient(server.http_url))


@pytest.fixture(params=["grpc", "http"])
def client(request: pytest.FixtureRequest, cuda_server: RunningServer) -> Iterator[Client]:
    if request.param == "grpc":
        connected = Client(
            "grpc", grpcclient, grpcclient.InferenceServerClient(cuda_server.grpc_url)
        )
    else:
        connected = Client(
            "http", httpclient, httpclient.InferenceServerClient(cuda_server.http_url)
        )
    yield connected
    connected.api.unregister_cuda_shared_memory()  # each test starts with none
    connected.api.unregister_system_shared_memory()
    connected.api.close()


class Regions:
    """The test's CUDA allocations, made by tritonclient; freed at the end."""

    def __init__(self) -> None:
        self.handles: list[Any] = []

    def create(self, byte_size: int, device: int = 0) -> Any:
        handle = cudashm.create_shared_memory_region(f"t{uuid.uuid4().hex}", byte_size, device)
        self.handles.append(handle)
        return handle

    def destroy(self) -> None:
        for handle in self.handles:
            cudashm.destroy_shared_memory_region(handle)


@pytest.fixture
def regions() -> Iterator[Regions]:
    made = Regions()
    yield made
    made.destroy()


def fp32(n: int = 16, seed: int = 0) -> Any:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def write(region: Any, at: int, data: Any) -> None:
    """``data`` at byte ``at`` of the region (tritonclient writes from the start)."""
    assert at % FLOAT == 0
    cudashm.set_shared_memory_region(region, [np.zeros(at // FLOAT, np.float32), data])


def read(region: Any, at: int, n: int, size: int) -> Any:
    return cudashm.get_contents_as_numpy(region, np.float32, [size // FLOAT])[
        at // FLOAT : at // FLOAT + n
    ]


# -- without a GPU: the calls, and what is refused before any handle is opened -----------
def test_status_and_unregister_with_no_regions(client: Client) -> None:
    assert client.status() == {}
    client.api.unregister_cuda_shared_memory("never-registered")  # a no-op, as Triton
    client.api.unregister_cuda_shared_memory()
    message = client.fails("NOT_FOUND", client.status, "nope")
    assert "Unable to find cuda shared memory region: 'nope'" in message


def test_malformed_handles(client: Client) -> None:
    """HTTP's handler checks the decoded handle's size itself; gRPC carries raw bytes, which
    Triton reads 64 of and fails to open."""
    for handle in (b"\1" * 10, b"\0" * 80):
        message = client.fails("INVALID_ARG", client.api.register_cuda_shared_memory,
                               "r", base64.b64encode(handle), 0, 64)  # fmt: skip
        if client.protocol == "http":
            assert message == TRITON["bad_handle"]
        else:
            assert message.startswith(TRITON["open_failed"] + ": "), message
            assert f"'raw_handle' is {len(handle)} bytes, a cudaIpcMemHandle_t is 64" in message
    if client.protocol == "http":  # only HTTP has base64 to break
        message = client.fails("INVALID_ARG", client.api.register_cuda_shared_memory,
                               "r", b"!!not base64!!", 0, 64)  # fmt: skip
        assert message == TRITON["bad_handle"]
    assert client.status() == {}


def test_registration_needs_a_region_name(cuda_server: RunningServer) -> None:
    """gRPC with an empty name; HTTP at the register route without a region (a path with an
    empty one, as tritonclient sends for "", is not a route: 404, as in Triton)."""
    expected = "'region name' is necessary to register cuda shared memory region"
    handle = base64.b64encode(b"\0" * 64)
    client = connect("grpc", cuda_server)
    message = client.fails("INVALID_ARG", client.api.register_cuda_shared_memory,
                           "", handle, 0, 64)  # fmt: skip
    assert message == expected
    client.api.close()
    body = {"raw_handle": {"b64": handle.decode()}, "byte_size": 64, "device_id": 0}
    assert post_json(cuda_server, "/v2/cudasharedmemory/register", body) == (400, expected)


def post_json(server: RunningServer, path: str, body: object) -> tuple[int, str]:
    """POST ``body`` as JSON; the status and the error's message."""
    request = urllib.request.Request(f"http://{server.http_url}{path}",
                                     data=json.dumps(body).encode(), method="POST")  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=DEADLINE_S)
    return info.value.code, str(json.loads(info.value.read())["error"])


def test_http_registration_needs_every_field(cuda_server: RunningServer) -> None:
    """Triton answers a missing field with JSON's own error (500); dlserve says which."""
    handle = base64.b64encode(b"\0" * 64).decode()
    bodies = {
        "raw_handle": {"byte_size": 64, "device_id": 0},
        "byte_size": {"raw_handle": {"b64": handle}, "device_id": 0},
        "device_id": {"raw_handle": {"b64": handle}, "byte_size": 64},
    }
    for missing, body in bodies.items():
        expected = f"Shared memory register request has no '{missing}' field"
        path = "/v2/cudasharedmemory/region/r/register"
        assert post_json(cuda_server, path, body) == (400, expected)


@pytest.mark.skipif(HAS_GPU, reason="a GPU is here: the GPU tests cover registration")
def test_registration_where_there_is_no_gpu(client: Client) -> None:
    """Without cuda-python, as Triton built without GPU support; with it but no device, as
    Triton built with it: the handle does not open."""
    handle = base64.b64encode(b"\0" * 64)
    message = client.fails("INVALID_ARG", client.api.register_cuda_shared_memory,
                           "r", handle, 0, 64)  # fmt: skip
    try:
        cuda_ipc.device_count()
    except cuda_ipc.CudaUnavailable:
        assert message.startswith(TRITON["not_supported"].format("r") + ": "), message
        assert "pip install 'dlserve[gpu]'" in message
    else:
        assert message.startswith(TRITON["open_failed"] + ": "), message
        assert "GPU 0 does not exist; this server sees 0 GPU(s)" in message
    assert client.status() == {}


def test_cuda_shared_memory_turned_off(tmp_path: Path) -> None:
    shutil.copytree(EXAMPLES / "add_sub", tmp_path / "add_sub")
    with run_server(tmp_path, "--allow-client-shm", "false") as server:
        client = connect("grpc", server)
        message = client.fails("UNSUPPORTED", client.api.register_cuda_shared_memory,
                               "r", base64.b64encode(b"\0" * 64), 0, 64)  # fmt: skip
        assert "Client shared memory is disabled" in message


# -- on a GPU --------------------------------------------------------------------------------
class TestOnTheGpu:
    pytestmark = gpu

    def test_register_status_unregister(self, client: Client, regions: Regions) -> None:
        a, b = regions.create(1024), regions.create(4096)
        client.register("a", a, 1000)  # any size up to the allocation's
        client.register("b", b, 4096)
        assert client.status() == {"a": (0, 1000), "b": (0, 4096)}
        assert client.status("a") == {"a": (0, 1000)}
        message = client.fails("ALREADY_EXISTS", client.register, "a", a, 1000)
        assert "shared memory region 'a' already in manager" in message
        client.api.unregister_cuda_shared_memory("a")
        assert client.status() == {"b": (0, 4096)}
        client.api.unregister_cuda_shared_memory()
        assert client.status() == {}

    def test_a_handle_that_does_not_open(self, client: Client) -> None:
        garbage = base64.b64encode(os.urandom(64))
        message = client.fails("INVALID_ARG", client.api.register_cuda_shared_memory,
                               "r", garbage, 0, 64)  # fmt: skip
        assert message.startswith(TRITON["open_failed"] + ": "), message
        assert "cannot be opened on GPU 0" in message and "--ipc=host" in message
        assert client.status() == {}

    def test_a_byte_size_past_the_allocation(self, client: Client, regions: Regions) -> None:
        region = regions.create(1024)
        message = client.fails("INVALID_ARG", client.register, "r", region, 1025)
        assert message.startswith(TRITON["size_refused"].format("r") + ": "), message
        assert "byte_size 1025 is larger than the allocation behind the handle" in message
        client.register("r", region, 1024)  # the whole allocation is fine
        assert client.status() == {"r": (0, 1024)}

    def test_a_device_that_does_not_exist(self, client: Client, regions: Regions) -> None:
        region = regions.create(1024)
        message = client.fails("INVALID_ARG", client.register, "r", region, 64, 99)
        assert message.startswith(TRITON["open_failed"] + ": "), message
        assert "GPU 99 does not exist" in message
        assert client.status() == {}

    def test_a_name_already_registered(self, client: Client, regions: Regions) -> None:
        region = regions.create(1024)
        client.register("r", region, 1024)
        message = client.fails("ALREADY_EXISTS", client.register, "r", region, 1024)
        assert message == TRITON["exists"].format("r")

    def test_offsets_past_the_region_at_inference(self, client: Client,
                                                  regions: Regions) -> None:  # fmt: skip
        region = regions.create(1024)
        client.register("r", region, 256)  # the region is 256 bytes of the allocation
        for at, expected in ((256, "bad_offset"), (200, "bad_span")):
            message = client.fails("INVALID_ARG", client.infer, "gpu_ops",
                                   [client.in_region("INPUT_0", [16], "r", at)],
                                   [client.output("OUTPUT_0")])  # fmt: skip
            assert message == TRITON[expected].format("r")

    def test_inputs_and_outputs_in_regions_at_offsets(self, client: Client,
                                                      regions: Regions) -> None:  # fmt: skip
        inputs, outputs = regions.create(4096), regions.create(4096)
        client.register("in", inputs, 4096)
        client.register("out", outputs, 4096)
        data = fp32()
        write(inputs, 1024, data)
        result, params = client.infer(
            "gpu_ops", [client.in_region("INPUT_0", [16], "in", at=1024)],
            [client.output("OUTPUT_0", "out", 64, at=512)],
        )  # fmt: skip
        assert params["is_cpu"] is False and params["input_device"] == 0
        described = result.get_output("OUTPUT_0")  # named and shaped, its bytes in the region
        shape = described.shape if client.protocol == "grpc" else described["shape"]
        assert list(shape) == [16]
        np.testing.assert_array_equal(read(outputs, 512, 16, 4096), data * 2)

    def test_the_model_writes_into_the_clients_gpu_memory(self, client: Client,
                                                          regions: Regions) -> None:  # fmt: skip
        region = regions.create(256)
        client.register("r", region, 256)
        data = fp32()
        write(region, 64, data)
        client.infer("gpu_ops", [client.in_region("INPUT_0", [16], "r", at=64)],
                     [client.output("OUTPUT_0", "r", 64, at=128)], op="in_place")  # fmt: skip
        np.testing.assert_array_equal(read(region, 64, 16, 256), data + 1)  # the client's own
        np.testing.assert_array_equal(read(region, 128, 16, 256), data + 1)

    def test_the_answer_waits_for_the_models_gpu_work_on_the_clients_memory(
        self, client: Client, regions: Regions
    ) -> None:
        """The model adds 1 to the client's region behind a long GPU sleep and answers from
        the host: the answer must not come before that work is done."""
        region = regions.create(64)
        client.register("r", region, 64)
        for seed in range(2):  # a process's first kernel launch loads the module and waits
            data = fp32(seed=seed)
            write(region, 0, data)
            client.infer("gpu_ops", [client.in_region("INPUT_0", [16], "r")],
                         [client.output("OUTPUT_0")], op="in_place_late")  # fmt: skip
            np.testing.assert_array_equal(read(region, 0, 16, 64), data + 1)

    @pytest.mark.parametrize("op", ["double", "double_cupy"])
    def test_torch_and_cupy_models(self, client: Client, regions: Regions, op: str) -> None:
        if op == "double_cupy":
            pytest.importorskip("cupy")
        region = regions.create(128)
        client.register("r", region, 128)
        data = fp32(seed=1)
        write(region, 0, data)
        client.infer("gpu_ops", [client.in_region("INPUT_0", [16], "r")],
                     [client.output("OUTPUT_0", "r", 64, at=64)], op=op)  # fmt: skip
        np.testing.assert_array_equal(read(region, 64, 16, 128), data * 2)

    @pytest.mark.parametrize("op", ["double", "as_numpy", "producer_gc", "buffer"])
    def test_gpu_inputs_with_outputs_on_the_wire(self, client: Client, regions: Regions,
                                                 op: str) -> None:  # fmt: skip
        n = 64 * 1024  # 256 KiB: through the worker's output arena
        region = regions.create(n * FLOAT)
        client.register("r", region, n * FLOAT)
        data = fp32(n, seed=2)
        write(region, 0, data)
        result, params = client.infer("gpu_ops", [client.in_region("INPUT_0", [n], "r")],
                                      [client.output("OUTPUT_0")], op=op)  # fmt: skip
        factor = 3 if op == "producer_gc" else 2
        np.testing.assert_array_equal(result.as_numpy("OUTPUT_0"), data * factor)
        if op == "buffer":
            assert params["buffer_is_cpu"] is True  # the response's place is host memory

    @pytest.mark.parametrize("op", ["producer_gc", "buffer"])
    def test_gpu_outputs_into_regions(self, client: Client, regions: Regions, op: str) -> None:
        region = regions.create(4096)
        client.register("r", region, 4096)
        data = fp32(seed=3)
        write(region, 0, data)
        _, params = client.infer("gpu_ops", [client.in_region("INPUT_0", [16], "r")],
                                 [client.output("OUTPUT_0", "r", 64, at=2048)], op=op)  # fmt: skip
        factor = 3 if op == "producer_gc" else 2
        np.testing.assert_array_equal(read(region, 2048, 16, 4096), data * factor)
        if op == "buffer":
            assert params["buffer_is_cpu"] is False  # a view of the client's GPU memory

    def test_input_placement(self, client: Client, regions: Regions) -> None:
        region = regions.create(64)
        client.register("r", region, 64)
        data = fp32(seed=4)
        write(region, 0, data)
        cases = {  # model, where the input comes from -> is_cpu in the model
            ("gpu_ops", "region"): False,  # stays where it arrived
            ("gpu_ops", "wire"): True,
            ("gpu_ops_cpu", "region"): True,  # Triton's behaviour
            ("gpu_ops_cpu", "wire"): True,
            ("gpu_ops_gpu", "region"): False,
            ("gpu_ops_gpu", "wire"): False,  # copied to the instance's GPU
        }
        for (model, source), is_cpu in cases.items():
            given = (client.in_region("INPUT_0", [16], "r") if source == "region"
                     else client.wire("INPUT_0", data))  # fmt: skip
            result, params = client.infer(model, [given], [client.output("OUTPUT_0")])
            assert params["is_cpu"] is is_cpu, (model, source)
            np.testing.assert_array_equal(result.as_numpy("OUTPUT_0"), data * 2)

    def test_the_instance_device_is_bound_before_initialize(self, client: Client) -> None:
        torch = pytest.importorskip("torch")
        _, params = client.infer("gpu_ops", [client.wire("INPUT_0", fp32())],
                                 [client.output("OUTPUT_0")])  # fmt: skip
        assert params["device_at_initialize"] == params["current_device"] == 0
        assert params["uuid"] == f"GPU-{torch.cuda.get_device_properties(0).uuid}"

    def test_the_guide_model_and_config_unchanged(self, client: Client, regions: Regions) -> None:
        shape = [1, 3, 224, 224]
        n = int(np.prod(shape))
        region = regions.create(n * FLOAT)
        client.register("input_shm", region, n * FLOAT)
        data = fp32(n, seed=5).reshape(shape)
        cudashm.set_shared_memory_region(region, [data])
        given = client.in_region("INPUT_0", shape, "input_shm")
        result = client.api.infer("your_python_model", [given])
        np.testing.assert_array_equal(result.as_numpy("OUTPUT_0"), data * 2)
        # from the wire too: force_gpu_tensors puts it on the GPU, as the guide's check wants
        result = client.api.infer("your_python_model", [client.wire("INPUT_0", data)])
        np.testing.assert_array_equal(result.as_numpy("OUTPUT_0"), data * 2)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="no CUDA device")
def test_unregister_while_a_request_is_in_flight(cuda_server: RunningServer, regions: Regions,
                                                  tmp_path: Path) -> None:  # fmt: skip
    client = connect("grpc", cuda_server)
    inputs, outputs = regions.create(64), regions.create(64)
    client.register("data", inputs, 64)
    client.register("out", outputs, 64)
    data = fp32()
    write(inputs, 0, data)
    started, go = tmp_path / "started", tmp_path / "go"
    for fifo in (started, go):
        os.mkfifo(fifo)
    control = np.array([str(started).encode(), str(go).encode()], np.object_)
    results: queue.Queue[Any] = queue.Queue()
    client.api.async_infer(
        "gated", [client.wire("CONTROL", control, "BYTES"), client.in_region("DATA", [16], "data")],
        lambda result, error: results.put(error or result),
        outputs=[client.output("OUTPUT0", "out", 64)],
    )  # fmt: skip
    with open(started) as fifo:  # blocks until execute has begun
        assert fifo.readline() == "started\n"
    try:
        client.api.unregister_cuda_shared_memory()  # succeeds at once
        assert client.status() == {"data": (0, 64), "out": (0, 64)}  # listed until it ends
    finally:
        with open(go, "w") as fifo:
            fifo.write("go\n")
    result = results.get(timeout=DEADLINE_S)
    assert not isinstance(result, Exception), result
    np.testing.assert_array_equal(read(outputs, 0, 16, 64), data * 2)  # completed correctly
    assert client.status() == {}  # ... then the regions went, with no further call
    client.api.close()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU or cuda_ipc.device_count() < 2, reason="needs two GPUs")
def test_a_request_goes_to_an_instance_on_its_inputs_gpu(tmp_path: Path,
                                                         regions: Regions) -> None:  # fmt: skip
    for name, gpus in (("on_both", "0, 1"), ("on_zero", "0")):
        shutil.copytree(TEST_MODELS / "gpu_ops", tmp_path / name)
        config = tmp_path / name / "config.pbtxt"
        config.write_text(
            config.read_text().replace("kind: KIND_GPU", f"kind: KIND_GPU gpus: [ {gpus} ]")
        )
    with run_server(tmp_path) as server:
        client = connect("grpc", server)
        region = regions.create(64, device=1)
        client.register("r", region, 64, device=1)
        data = fp32(seed=6)
        cudashm.set_shared_memory_region(region, [data])
        for _ in range(4):  # every time, whatever the instances' load
            result, params = client.infer("on_both", [client.in_region("INPUT_0", [16], "r")],
                                          [client.output("OUTPUT_0")])  # fmt: skip
            assert (params["input_device"], params["current_device"]) == (1, 1)
            np.testing.assert_array_equal(result.as_numpy("OUTPUT_0"), data * 2)
        result, params = client.infer("on_zero", [client.in_region("INPUT_0", [16], "r")],
                                      [client.output("OUTPUT_0")])  # fmt: skip
        assert (params["input_device"], params["current_device"]) == (1, 0)  # across devices
        np.testing.assert_array_equal(result.as_numpy("OUTPUT_0"), data * 2)
        metrics = urllib.request.urlopen(server.metrics_url, timeout=DEADLINE_S).read().decode()
        assert 'dlserve_cross_device_requests_total{model="on_zero",version="1"} 1' in metrics
        assert 'dlserve_cross_device_requests_total{model="on_both",version="1"} 0' in metrics
        client.api.unregister_cuda_shared_memory()
        client.api.close()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="no CUDA device")
def test_a_streams_final_response_waits_for_the_gpu_work_on_the_clients_memory(
    cuda_server: RunningServer, regions: Regions
) -> None:
    """A decoupled model adds 1 to the client's region behind a long GPU sleep and sends
    host responses: the final one must not come before that work is done."""
    client = connect("grpc", cuda_server)
    region = regions.create(64)
    client.register("r", region, 64)
    results: queue.Queue[Any] = queue.Queue()
    client.api.start_stream(callback=lambda result, error: results.put(error or result))
    try:
        for seed in range(2):  # a process's first kernel launch loads the module and waits
            data = fp32(seed=seed)
            write(region, 0, data)
            client.api.async_stream_infer("gpu_stream_late",
                                          [client.in_region("INPUT_0", [16], "r")],
                                          enable_empty_final_response=True)  # fmt: skip
            while True:
                result = results.get(timeout=DEADLINE_S)
                assert not isinstance(result, Exception), result
                final = result.get_response().parameters.get("triton_final_response")
                if final is not None and final.bool_param:
                    break
            np.testing.assert_array_equal(read(region, 0, 16, 64), data + 1)
    finally:
        client.api.stop_stream()
        client.api.unregister_cuda_shared_memory()
        client.api.close()
