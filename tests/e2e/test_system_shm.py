"""System shared memory through a real server, driven by unmodified tritonclient
(``tritonclient.utils.shared_memory`` for the regions), over gRPC and HTTP.

- register / status / unregister / unregister all, and every error with its code;
- inputs and outputs in regions at non-zero, non-page-aligned offsets; raw and shared-memory
  inputs mixed; BYTES in regions;
- zero copy, proven: a model that writes into its input changes the client's own region,
  the worker maps the client's object and the server process never does;
- unregistering during an in-flight request: it succeeds at once, the regions stay listed
  until the request ends, then go, and the worker unmaps them with no further call;
- a client that truncates its object after registering it: the request fails cleanly, the
  server and the worker stay up;
- who may register: a remote peer is refused by default.
"""

from __future__ import annotations

import os
import platform
import queue
import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException, serialize_byte_tensor

from conftest import EXAMPLES, TEST_MODELS, RunningServer, repository_of, run_server

PAGE = os.sysconf("SC_PAGE_SIZE")
DEADLINE_S = 60.0
RNG = np.random.default_rng(3)
STATUS = {  # code -> (gRPC status, HTTP status)
    "INVALID_ARG": ("INVALID_ARGUMENT", "400"),
    "NOT_FOUND": ("NOT_FOUND", "404"),
    "ALREADY_EXISTS": ("ALREADY_EXISTS", "400"),
    "INTERNAL": ("INTERNAL", "500"),
    "UNSUPPORTED": ("UNIMPLEMENTED", "501"),
}


MODELS = (EXAMPLES / "add_sub", EXAMPLES / "identity_bytes", TEST_MODELS / "in_place",
          TEST_MODELS / "gated")  # fmt: skip


@pytest.fixture(scope="module")
def shm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    with run_server(repository_of(tmp_path_factory.mktemp("shm_repo"), *MODELS)) as server:
        yield server


@dataclass
class Client:
    """One tritonclient and the calls whose shapes differ between gRPC and HTTP."""

    protocol: str
    lib: Any
    api: Any

    def fails(self, code: str, call: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
        with pytest.raises(InferenceServerException) as info:
            call(*args, **kwargs)
        grpc_status, http_status = STATUS[code]
        expected = f"StatusCode.{grpc_status}" if self.protocol == "grpc" else http_status
        assert str(info.value.status()) == expected, info.value.message()
        return str(info.value.message())

    def status(self, name: str = "") -> dict[str, tuple[str, int, int]]:
        got = self.api.get_system_shared_memory_status(name)
        if self.protocol == "grpc":
            return {n: (r.key, r.offset, r.byte_size) for n, r in got.regions.items()}
        return {r["name"]: (r["key"], r["offset"], r["byte_size"]) for r in got}

    def register(self, name: str, key: str, byte_size: int, offset: int = 0) -> None:
        self.api.register_system_shared_memory(name, key, byte_size, offset=offset)

    def tensor(self, name: str, array: Any, datatype: str = "FP32") -> Any:
        tensor = self.lib.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        return tensor

    def in_region(self, name: str, shape: list[int], region: str, size: int, at: int = 0) -> Any:
        return self.lib.InferInput(name, shape, "FP32").set_shared_memory(region, size, offset=at)

    def output(self, name: str, region: str | None = None, size: int = 0, at: int = 0) -> Any:
        output = self.lib.InferRequestedOutput(name)
        if region is not None:
            output.set_shared_memory(region, size, offset=at)
        return output


def connect(protocol: str, url: str) -> Client:
    if protocol == "grpc":
        return Client("grpc", grpcclient, grpcclient.InferenceServerClient(url))
    return Client("http", httpclient, httpclient.InferenceServerClient(url))


@pytest.fixture(params=["grpc", "http"])
def client(request: pytest.FixtureRequest, shm_server: RunningServer) -> Iterator[Client]:
    url = shm_server.grpc_url if request.param == "grpc" else shm_server.http_url
    connected = connect(request.param, url)
    yield connected
    connected.api.unregister_system_shared_memory()  # each test starts with none
    connected.api.close()


class Objects:
    """The test's shared-memory objects, made by tritonclient; destroyed at the end."""

    def __init__(self) -> None:
        self.handles: list[Any] = []

    def create(self, size: int) -> tuple[Any, str]:
        key = f"/shmtest_{uuid.uuid4().hex}"
        handle = shm.create_shared_memory_region(key, key, size)
        self.handles.append(handle)
        return handle, key

    def destroy(self) -> None:
        for handle in self.handles:
            shm.destroy_shared_memory_region(handle)


@pytest.fixture
def objects() -> Iterator[Objects]:
    made = Objects()
    yield made
    made.destroy()


def fp32(n: int = 16) -> Any:
    return RNG.standard_normal(n).astype(np.float32)


def read(handle: Any, offset: int, n: int = 16) -> Any:
    return shm.get_contents_as_numpy(handle, np.float32, [n], offset=offset).copy()


def maps(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def mapping_processes(server: RunningServer, key: str) -> list[int]:
    """Pids of the server and its workers that map the object ``key``."""
    server_process = psutil.Process(server.process.pid)
    pids = [server_process.pid] + [p.pid for p in server_process.children(recursive=True)]
    return [pid for pid in pids if f"/dev/shm/{key.lstrip('/')}" in maps(pid)]


# -- register, status, unregister ---------------------------------------------------------
def test_register_status_unregister(client: Client, objects: Objects) -> None:
    _, key = objects.create(3 * PAGE)
    client.register("a", key, 100, offset=PAGE + 3)  # any offset, page-aligned or not
    client.register("b", key, 3 * PAGE)
    assert client.status() == {"a": (key, PAGE + 3, 100), "b": (key, 0, 3 * PAGE)}
    assert client.status("a") == {"a": (key, PAGE + 3, 100)}
    client.api.unregister_system_shared_memory("a")
    assert client.status() == {"b": (key, 0, 3 * PAGE)}
    client.api.unregister_system_shared_memory("never-registered")  # a no-op, as Triton
    client.api.unregister_system_shared_memory()  # all
    assert client.status() == {}


def test_register_errors(client: Client, objects: Objects) -> None:
    _, key = objects.create(64)
    client.register("r", key, 64)
    message = client.fails("ALREADY_EXISTS", client.register, "r", key, 64)
    assert "shared memory region 'r' already in manager" in message
    for bad in ("/", "///"):
        message = client.fails("INVALID_ARG", client.register, "x", bad, 8)
        assert f"cannot register shared memory region 'x' - invalid shm key '{bad}'" in message
    for bad in ("triton_python_backend_shm_region_a", "//triton_python_backend_shm_region_a",
                "/dlserve_0_in", "dlserve_x"):  # fmt: skip
        message = client.fails("INVALID_ARG", client.register, "x", bad, 8)
        assert "as the key contains the reserved prefix" in message
    message = client.fails("INTERNAL", client.register, "x", "/no_such_shmtest_object", 8)
    assert "Unable to open shared memory region: '/no_such_shmtest_object'" in message
    for size, offset in ((65, 0), (64, 1), (1, 64), (0, 65), (8, 2**63 - 1), (1, 2**64 - 1)):
        message = client.fails("INVALID_ARG", client.register, "x", key, size, offset)
        assert "failed to register shared memory region 'x': invalid args" in message
    message = client.fails("NOT_FOUND", client.status, "x")
    assert "Unable to find system shared memory region: 'x'" in message
    assert list(client.status()) == ["r"]


# -- inference ----------------------------------------------------------------------------
def test_inputs_and_outputs_in_regions(
    client: Client, objects: Objects, shm_server: RunningServer
) -> None:
    """Regions at unaligned offsets of their objects, tensors at unaligned offsets in them."""
    inputs, in_key = objects.create(3 * PAGE)
    outputs, out_key = objects.create(PAGE)
    client.register("in", in_key, 200, offset=PAGE + 3)
    client.register("out", out_key, 300, offset=5)
    a, b = fp32(), fp32()
    shm.set_shared_memory_region(inputs, [a], offset=PAGE + 3)
    shm.set_shared_memory_region(inputs, [b], offset=PAGE + 3 + 67)
    tensors = [client.in_region("INPUT0", [16], "in", 64),
               client.in_region("INPUT1", [16], "in", 64, 67)]  # fmt: skip
    outputs_wanted = [client.output("OUTPUT0", "out", 64, 1),
                      client.output("OUTPUT1", "out", 80, 129)]  # fmt: skip
    result = client.api.infer("add_sub", tensors, outputs=outputs_wanted)
    np.testing.assert_array_equal(read(outputs, 6), a + b)
    np.testing.assert_array_equal(read(outputs, 134), a - b)
    for name in ("OUTPUT0", "OUTPUT1"):  # name, datatype and shape; the data is in the region
        output = result.get_output(name)
        if client.protocol == "grpc":
            assert (output.datatype, list(output.shape)) == ("FP32", [16])
        else:
            assert output == {"name": name, "datatype": "FP32", "shape": [16]}
    # the worker maps the client's objects; the server process never does
    assert mapping_processes(shm_server, in_key)
    assert shm_server.process.pid not in mapping_processes(shm_server, in_key)
    assert shm_server.process.pid not in mapping_processes(shm_server, out_key)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="glibc's x86 tunable")
def test_workers_write_outputs_with_non_temporal_stores(shm_server: RunningServer) -> None:
    """The workers (which write outputs into clients' regions) run with glibc's
    non-temporal-store threshold at 1 MiB."""
    server_process = psutil.Process(shm_server.process.pid)
    workers = server_process.children(recursive=True)
    assert workers
    setting = "glibc.cpu.x86_non_temporal_threshold=0x100000"
    for worker in workers:
        assert setting in worker.environ().get("GLIBC_TUNABLES", "")


def test_raw_and_shared_memory_inputs_mixed(client: Client, objects: Objects) -> None:
    handle, key = objects.create(256)
    client.register("r", key, 256)
    a, b = fp32(), fp32()
    shm.set_shared_memory_region(handle, [a], offset=8)
    result = client.api.infer(
        "add_sub",
        [client.in_region("INPUT0", [16], "r", 64, 8), client.tensor("INPUT1", b)],
        outputs=[client.output("OUTPUT0", "r", 64, 128), client.output("OUTPUT1")],
    )
    np.testing.assert_array_equal(read(handle, 128), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)


def test_bytes_in_regions(client: Client, objects: Objects) -> None:
    values = np.array([b"one", b"", "três".encode(), b"\0\xff"], dtype=np.object_)
    serialized = serialize_byte_tensor(values)
    size = len(serialized.item())
    handle, key = objects.create(2 * size + 7)
    client.register("r", key, 2 * size + 7)
    shm.set_shared_memory_region(handle, [serialized], offset=3)
    tensor = client.lib.InferInput("INPUT0", [4], "BYTES").set_shared_memory("r", size, offset=3)
    client.api.infer(
        "identity_bytes", [tensor], outputs=[client.output("OUTPUT0", "r", size, size + 5)]
    )
    got = shm.get_contents_as_numpy(handle, np.object_, [4], offset=size + 5)
    assert list(got) == list(values)
    tensor = client.lib.InferInput("INPUT0", [5], "BYTES").set_shared_memory("r", size, offset=3)
    message = client.fails("INVALID_ARG", client.api.infer, "identity_bytes", [tensor])
    assert (
        "unexpected number of string elements 4 for inference input 'INPUT0', expecting 5"
        in message
    )


def test_the_model_writes_into_the_clients_memory(client: Client, objects: Objects) -> None:
    """Zero copy: in_place adds 1 to its input where it lies, the client's region."""
    handle, key = objects.create(PAGE)
    client.register("r", key, 200, offset=13)
    data = fp32()
    shm.set_shared_memory_region(handle, [data], offset=13 + 4)
    result = client.api.infer(
        "in_place",
        [client.in_region("INPUT0", [16], "r", 64, 4)],
        outputs=[client.output("OUTPUT0"), client.output("SAME_MEMORY")],
    )
    assert result.as_numpy("SAME_MEMORY")[0]
    np.testing.assert_array_equal(read(handle, 13 + 4), data + 1)  # the client's own memory
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), data + 1)


def test_inference_errors(client: Client, objects: Objects) -> None:
    _, key = objects.create(PAGE + 128)
    client.register("r", key, 128, offset=PAGE)
    ok = client.in_region("INPUT0", [16], "r", 64)

    def infer(input1: Any, output: Any = None) -> Callable[[], Any]:
        outputs = None if output is None else [output]
        return lambda: client.api.infer("add_sub", [ok, input1], outputs=outputs)

    input1 = client.in_region("INPUT1", [16], "r", 64)

    cases: list[tuple[str, Callable[[], Any], str]] = [
        ("NOT_FOUND", infer(client.in_region("INPUT1", [16], "nope", 64)),
         "Unable to find shared memory region: 'nope'"),
        ("INVALID_ARG", infer(client.in_region("INPUT1", [16], "r", 64, 128)),
         "Invalid offset for shared memory region: 'r'"),
        ("INVALID_ARG", infer(client.in_region("INPUT1", [16], "r", 64, 65)),
         "Invalid offset + byte size for shared memory region: 'r'"),
        ("INVALID_ARG", infer(client.in_region("INPUT1", [16], "r", 64, 2**63 - 1)),
         "Invalid offset for shared memory region: 'r'"),
        ("INVALID_ARG", infer(client.in_region("INPUT1", [16], "r", 128)),
         "input byte size mismatch for input 'INPUT1' for model 'add_sub'. Expected 64, got 128"),
        ("NOT_FOUND", infer(input1, client.output("OUTPUT0", "nope", 64)),
         "Unable to find shared memory region: 'nope'"),
        ("INTERNAL", infer(input1, client.output("OUTPUT0", "r", 32)),
         "shared memory size specified with the request for output 'OUTPUT0' (32 bytes) should "
         "be at least 64 bytes to hold the results"),
    ]  # fmt: skip
    if client.protocol == "http":  # gRPC's int64 parameters cannot carry these
        cases += [
            ("INVALID_ARG", infer(client.in_region("INPUT1", [16], "r", 64, 2**64 - 32)),
             "Invalid offset for shared memory region: 'r'"),
            ("INVALID_ARG", infer(client.in_region("INPUT1", [16], "r", 2**64 - 32, 32)),
             "Integer overflow detected: byte_size (18446744073709551584) + offset (32) exceeds "
             "maximum value (18446744073709551615) for region 'r'"),
        ]  # fmt: skip
    for code, call, message in cases:
        assert message in client.fails(code, call)
    client.api.unregister_system_shared_memory("r")  # failed requests held nothing
    assert client.status() == {}


# -- unregistering while a request is in flight ---------------------------------------------
class GatedRequest:
    """A request to the ``gated`` model, held inside execute until :meth:`finish`."""

    def __init__(self, client: Client, url: str, folder: Path, data: Any, outputs: list[Any]):
        self.started, self.go = folder / f"started-{uuid.uuid4().hex}", folder / "go"
        for fifo in (self.started, self.go):
            fifo.unlink(missing_ok=True)
            os.mkfifo(fifo)
        control = np.array([str(self.started).encode(), str(self.go).encode()], np.object_)
        self.results: queue.Queue[Any] = queue.Queue()
        inputs = [client.tensor("CONTROL", control, "BYTES"), data]
        if client.protocol == "grpc":
            client.api.async_infer("gated", inputs, self._done, outputs=outputs)
        else:  # its own client in its own thread: tritonclient.http's async needs gevent
            threading.Thread(target=self._http, args=(url, inputs, outputs), daemon=True).start()
        with open(self.started) as started:  # blocks until execute has begun
            assert started.readline() == "started\n"

    def _done(self, result: Any, error: Any) -> None:
        self.results.put(error or result)

    def _http(self, url: str, inputs: list[Any], outputs: list[Any]) -> None:
        try:
            with httpclient.InferenceServerClient(url) as own:
                self.results.put(own.infer("gated", inputs, outputs=outputs))
        except Exception as exc:
            self.results.put(exc)

    def finish(self) -> Any:
        with open(self.go, "w") as go:
            go.write("go\n")
        result = self.results.get(timeout=DEADLINE_S)
        if isinstance(result, Exception):
            raise result
        return result


def test_unregister_while_a_request_is_in_flight(
    client: Client, objects: Objects, shm_server: RunningServer, tmp_path: Path
) -> None:
    url = shm_server.grpc_url if client.protocol == "grpc" else shm_server.http_url
    inputs, in_key = objects.create(PAGE)
    outputs, out_key = objects.create(PAGE)
    client.register("data", in_key, 64, offset=3)
    client.register("out", out_key, 64, offset=9)
    data = fp32()
    shm.set_shared_memory_region(inputs, [data], offset=3)
    held = GatedRequest(client, url, tmp_path, client.in_region("DATA", [16], "data", 64),
                        [client.output("OUTPUT0", "out", 64)])  # fmt: skip
    try:
        [worker] = mapping_processes(shm_server, in_key)
        assert worker != shm_server.process.pid
        client.api.unregister_system_shared_memory()  # succeeds at once
        assert client.status() == {"data": (in_key, 3, 64), "out": (out_key, 9, 64)}
        client.fails("ALREADY_EXISTS", client.register, "data", in_key, 64)
    finally:
        result = held.finish()
    assert result.get_output("OUTPUT0") is not None
    np.testing.assert_array_equal(read(outputs, 9), data * 2)  # the request completed correctly
    assert client.status() == {}  # ... and then the regions went, with no further call
    # The worker handles frames in order: once the next request is answered, it has
    # handled the unmap that the server sent when the first one finished.
    GatedRequest(client, url, tmp_path, client.tensor("DATA", data), []).finish()
    assert in_key.lstrip("/") not in maps(worker) and out_key.lstrip("/") not in maps(worker)


# -- a client that truncates its object ----------------------------------------------------
def test_a_truncated_object_fails_the_request_cleanly(
    client: Client, objects: Objects, shm_server: RunningServer
) -> None:
    _, key = objects.create(2 * PAGE)
    client.register("r", key, 2 * PAGE - 100, offset=100)

    def infer() -> Any:
        tensor = client.in_region("INPUT0", [16], "r", 64, PAGE)  # in the object's second page
        return client.api.infer("in_place", [tensor], outputs=[client.output("OUTPUT0")])

    infer()  # the worker has mapped the object now
    [worker] = mapping_processes(shm_server, key)
    fd = os.open(f"/dev/shm/{key.lstrip('/')}", os.O_RDWR)
    try:
        os.ftruncate(fd, PAGE)  # the client shrinks it: touching the second page is SIGBUS
        message = client.fails("INVALID_ARG", infer)
        assert f"the shared memory object '{key}'" in message and "truncated" in message
        assert shm_server.alive() and psutil.pid_exists(worker)
        assert client.api.is_model_ready("in_place")
        os.ftruncate(fd, 2 * PAGE)  # grown again (zeros): the same mapping serves
        np.testing.assert_array_equal(infer().as_numpy("OUTPUT0"), np.ones(16, np.float32))
        assert mapping_processes(shm_server, key) == [worker]
    finally:
        os.close(fd)


def test_an_object_truncated_before_its_first_use(client: Client, objects: Objects) -> None:
    _, key = objects.create(PAGE)
    client.register("r", key, PAGE)
    os.truncate(f"/dev/shm/{key.lstrip('/')}", 0)
    tensor = client.in_region("INPUT0", [16], "r", 64)
    message = client.fails("INVALID_ARG", client.api.infer, "in_place", [tensor])
    assert "truncated" in message
    assert client.api.is_model_ready("in_place")


# -- who may register -----------------------------------------------------------------------
def _external_address() -> str | None:
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == socket.AF_INET and not address.address.startswith("127."):
                return str(address.address)
    return None


def test_remote_peers_are_refused_by_default(objects: Objects, tmp_path: Path) -> None:
    external = _external_address()
    if external is None:
        pytest.skip("no network interface but loopback")
    _, key = objects.create(64)
    repository = repository_of(tmp_path, TEST_MODELS / "in_place")
    with run_server(repository, "--host", "0.0.0.0") as server:
        for protocol, port in (("grpc", server.grpc_port), ("http", server.http_port)):
            local = connect(protocol, f"127.0.0.1:{port}")
            remote = connect(protocol, f"{external}:{port}")
            message = remote.fails("UNSUPPORTED", remote.register, "r", key, 64)
            assert "local clients only (loopback or a Unix socket); this request came from " \
                f"'{external}'" in message  # fmt: skip
            local.register("r", key, 64)
            assert remote.status() == {"r": (key, 0, 64)}  # status is not refused
            tensor = remote.in_region("INPUT0", [16], "r", 64)
            message = remote.fails("UNSUPPORTED", remote.api.infer, "in_place", [tensor])
            assert "local clients only" in message  # a remote client may not use local memory
            remote.fails("UNSUPPORTED", remote.api.unregister_system_shared_memory)
            local.api.unregister_system_shared_memory()
            for each in (local, remote):
                each.api.close()


def test_remote_peers_when_anyone_is_allowed(objects: Objects, tmp_path: Path) -> None:
    external = _external_address()
    if external is None:
        pytest.skip("no network interface but loopback")
    handle, key = objects.create(64)
    repository = repository_of(tmp_path, TEST_MODELS / "in_place")
    with run_server(repository, "--host", "0.0.0.0", "--allow-client-shm=any") as server:
        for url in (f"{external}:{server.grpc_port}", f"{external}:{server.http_port}"):
            remote = connect("grpc" if url.endswith(str(server.grpc_port)) else "http", url)
            remote.register("r", key, 64)
            shm.set_shared_memory_region(handle, [np.zeros(16, np.float32)])
            remote.api.infer("in_place", [remote.in_region("INPUT0", [16], "r", 64)])
            np.testing.assert_array_equal(read(handle, 0), np.ones(16, np.float32))
            remote.api.unregister_system_shared_memory()
            remote.api.close()


def test_client_shared_memory_turned_off(objects: Objects, tmp_path: Path) -> None:
    _, key = objects.create(64)
    repository = repository_of(tmp_path, TEST_MODELS / "in_place")
    with run_server(repository, "--allow-client-shm=false") as server:
        for protocol, url in (("grpc", server.grpc_url), ("http", server.http_url)):
            client = connect(protocol, url)
            calls = ((client.register, "r", key, 64), (client.api.unregister_system_shared_memory,),
                     (client.api.unregister_system_shared_memory, "r"))  # fmt: skip
            for call, *args in calls:
                message = client.fails("UNSUPPORTED", call, *args)
                assert "Client shared memory is disabled" in message
            assert client.status() == {}  # status still answers, as Triton's does
            tensor = client.in_region("INPUT0", [16], "r", 64)
            client.fails("NOT_FOUND", client.api.infer, "in_place", [tensor])
            client.api.close()
