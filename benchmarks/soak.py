"""Soak: 64 concurrent clients for a long time, with faults, and what the server holds after.

dlserve serves ``add_sub`` (examples/models), ``identity_4mb`` (benchmarks/models) and the
decoupled ``flood`` (tests/models). 8 spawned client processes of 8 threads each (64
unmodified tritonclient clients, gRPC and HTTP mixed) send, back to back:

- small requests (add_sub, FP32[16]), checked against the sum and difference;
- 4 MB requests (identity_4mb) over the wire, and through system shared memory: regions
  registered, used for 10 requests (a stamp written per request), unregistered, destroyed;
- streams (ModelStreamInfer): 8 add_sub requests per stream, each response checked by id;
  every 4th stream asks flood for 2000 responses, reads 10 and is cancelled
  (``stop_stream(cancel_requests=True)``).

Every ``--fault-every`` seconds one fault, in turn: a model worker process SIGKILLed (the
server's children, found with psutil); a client process SIGKILLed while it holds two
registered regions (the server should reclaim them: the benchmark waits until they leave
``/v2/systemsharedmemory/status``); a burst of cancelled flood streams; two slow readers
(raw sockets asking for a 16 MB output, reading nothing, closed after ``--slow-hold`` s).

    .venv/bin/python benchmarks/soak.py [--duration 600] [--warmup 60] [--fault-every 30]
        [--settle 10] [--json PATH]

Prints the requests served, wrong and failed per kind of request; the errors split into
allowed (in the window of a worker kill, with the text of a lost instance: the kill's
in-flight requests and those sent while it restarts) and unexpected; the wrong answers
(must be 0); the faults and what followed them (restart time, time to reclaim the killed
client's regions). Then, for the server process and its workers apart: RSS, open fds,
threads and the /dev/shm objects they map or hold open, at idle (one request of each kind
sent), start (``--settle`` s after ``--warmup`` s of the same load with each fault once:
thread pools and arenas have grown to what the load needs, and the idle server has given
its freed heap back), peak (sampled every 2 s during the
soak) and end (the clients gone, ``--settle`` s later), with end at most 10 % above start
as pass/fail (a leak grows; less at the end is memory given back). A benchmark, not a
test: it exits 0 whatever it finds.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import json
import multiprocessing
import os
import platform
import queue
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from multiprocessing import shared_memory
from multiprocessing.sharedctypes import SynchronizedArray
from pathlib import Path
from typing import Any

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _triton  # a sibling module, not a package

ROOT = Path(__file__).resolve().parents[1]
MODELS = (
    ROOT / "examples" / "models" / "add_sub",
    ROOT / "benchmarks" / "models" / "identity_4mb",
    ROOT / "tests" / "models" / "flood",
)
SMALL = 16
LARGE = 1024 * 1024  # FP32 elements: 4 MB
LARGE_BYTES = LARGE * 4
PROCESSES = 8
THREADS = 8
VICTIM_SLOTS = 64  # slots for the killed clients' counters (one per kill at most)
FIELDS = ("ok", "wrong", "errors", "cancelled")
TIMEOUT_S = 30.0  # every call's deadline: a hang shows as an error
SHM_REQUESTS = 10  # requests per registration
STREAM_REQUESTS = 8
FLOOD_COUNT, FLOOD_SIZE, FLOOD_READ = 2000, 1024, 10
SAMPLE_S = 2.0
TOLERANCE = 0.10
# the texts of a request that met a killed instance or its restart (docs/differences.md)
LOST_INSTANCE = ("is not healthy", "has no available versions", "is available (restarting)")
WORKER_KILL_GRACE_S = 5.0  # after every model is ready again, late answers may still fail


# --- the kinds of request (run in client processes) ------------------------------------------


@dataclass(frozen=True)
class Role:
    """What one client thread sends: ``small``, ``wire``, ``shm`` or ``stream``, and how."""

    kind: str
    protocol: str  # "grpc" or "http"

    @property
    def name(self) -> str:
        return f"{self.kind}/{self.protocol}"


def role_of(process: int, thread: int) -> Role:
    """The fixed mix: per process 4 small, 1 wire, 1 shm, 2 streams; protocols alternate."""
    even = process % 2 == 0
    kinds = ("small", "small", "small", "small", "wire", "shm", "stream", "stream")
    protocols = (
        "grpc",
        "http",
        "grpc",
        "http",
        "grpc" if even else "http",
        "http" if even else "grpc",
        "grpc",
        "grpc",
    )
    return Role(kinds[thread], protocols[thread])


@dataclass
class Slot:
    """One thread's counters in the shared array (one writer each: no lock)."""

    array: SynchronizedArray[Any]
    index: int

    def add(self, name: str, count: int = 1) -> None:
        self.array[self.index * len(FIELDS) + FIELDS.index(name)] += count


def client_module(protocol: str) -> Any:
    """tritonclient.grpc or tritonclient.http."""
    if protocol == "grpc":
        import tritonclient.grpc as module
    else:
        import tritonclient.http as module
    return module


def make_client(protocol: str, url: str) -> Any:
    module = client_module(protocol)
    if protocol == "grpc":
        return module.InferenceServerClient(url)
    return module.InferenceServerClient(
        url, connection_timeout=TIMEOUT_S, network_timeout=TIMEOUT_S
    )


def call(client: Any, model: str, inputs: list[Any], outputs: list[Any]) -> Any:
    """One unary request with the benchmark's deadline (gRPC: client_timeout)."""
    if hasattr(client, "start_stream"):
        return client.infer(model, inputs, outputs=outputs, client_timeout=TIMEOUT_S)
    return client.infer(model, inputs, outputs=outputs)


def small_request(client: Any, protocol: str, rng: np.random.Generator) -> bool:
    """One add_sub request with fresh data; whether both outputs are right."""
    module = client_module(protocol)
    arrays = [rng.random(SMALL, dtype=np.float32) for _ in range(2)]
    inputs = [module.InferInput(f"INPUT{i}", [SMALL], "FP32") for i in range(2)]
    for tensor, array in zip(inputs, arrays, strict=True):
        tensor.set_data_from_numpy(array)
    outputs = [module.InferRequestedOutput(f"OUTPUT{i}") for i in range(2)]
    result = call(client, "add_sub", inputs, outputs)
    return bool(
        np.array_equal(result.as_numpy("OUTPUT0"), arrays[0] + arrays[1])
        and np.array_equal(result.as_numpy("OUTPUT1"), arrays[0] - arrays[1])
    )


def wire_request(client: Any, protocol: str, data: np.ndarray, stamp: int) -> bool:
    """One 4 MB identity request, the tensor in the request and the response."""
    module = client_module(protocol)
    data[0] = stamp
    tensor = module.InferInput("INPUT0", [LARGE], "FP32")
    tensor.set_data_from_numpy(data)
    result = call(client, "identity_4mb", [tensor], [module.InferRequestedOutput("OUTPUT0")])
    return bool(np.array_equal(result.as_numpy("OUTPUT0"), data))


@contextlib.contextmanager
def shm_regions(client: Any, tag: str) -> Iterator[tuple[Any, Any]]:
    """Two 4 MB regions (``tag_in``, ``tag_out``), created and registered; gone after."""
    import tritonclient.utils.shared_memory as shm

    handles = []
    try:
        for name in ("in", "out"):
            handles.append(
                shm.create_shared_memory_region(f"{tag}_{name}", f"/{tag}_{name}", LARGE_BYTES)
            )
            client.register_system_shared_memory(f"{tag}_{name}", f"/{tag}_{name}", LARGE_BYTES)
        yield handles[0], handles[1]
    finally:
        with contextlib.suppress(Exception):  # the request's own error is the one to report
            for name in ("in", "out")[: len(handles)]:
                client.unregister_system_shared_memory(f"{tag}_{name}")
        for handle in handles:
            shm.destroy_shared_memory_region(handle)


def shm_request(
    client: Any, protocol: str, tag: str, regions: tuple[Any, Any], data: np.ndarray, stamp: int
) -> bool:
    """One 4 MB request through the regions: a new stamp in, the output's stamp cleared."""
    import tritonclient.utils.shared_memory as shm

    module = client_module(protocol)
    data[0] = stamp
    shm.set_shared_memory_region(regions[0], [data[:1]])
    shm.set_shared_memory_region(regions[1], [np.zeros(1, np.float32)])
    tensor = module.InferInput("INPUT0", [LARGE], "FP32")
    tensor.set_shared_memory(f"{tag}_in", LARGE_BYTES)
    output = module.InferRequestedOutput("OUTPUT0")
    output.set_shared_memory(f"{tag}_out", LARGE_BYTES)
    call(client, "identity_4mb", [tensor], [output])
    answer = shm.get_contents_as_numpy(regions[1], np.float32, [LARGE])
    return bool(np.array_equal(answer, data))


def stream_of_add_sub(client: Any, rng: np.random.Generator) -> tuple[int, int]:
    """One stream of add_sub requests; (right, wrong) answers. Errors raise."""
    import tritonclient.grpc as grpcclient

    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    expected = {}
    try:
        for index in range(STREAM_REQUESTS):
            arrays = [rng.random(SMALL, dtype=np.float32) for _ in range(2)]
            inputs = [grpcclient.InferInput(f"INPUT{i}", [SMALL], "FP32") for i in range(2)]
            for tensor, array in zip(inputs, arrays, strict=True):
                tensor.set_data_from_numpy(array)
            expected[str(index)] = arrays
            client.async_stream_infer("add_sub", inputs, request_id=str(index))
        right = 0
        for _ in range(STREAM_REQUESTS):
            result, error = answers.get(timeout=TIMEOUT_S)
            if error is not None:
                raise error
            arrays = expected.pop(result.get_response().id)
            right += bool(np.array_equal(result.as_numpy("OUTPUT0"), arrays[0] + arrays[1]))
        return right, STREAM_REQUESTS - right
    finally:
        client.stop_stream(cancel_requests=True)


def cancelled_flood(client: Any) -> tuple[int, int]:
    """A flood stream read for FLOOD_READ responses, then cancelled; (right, wrong)."""
    import tritonclient.grpc as grpcclient

    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        inputs = []
        for name, value in (("COUNT", FLOOD_COUNT), ("SIZE", FLOOD_SIZE)):
            inputs.append(grpcclient.InferInput(name, [1], "INT32"))
            inputs[-1].set_data_from_numpy(np.array([value], dtype=np.int32))
        client.async_stream_infer("flood", inputs)
        right = 0
        for index in range(FLOOD_READ):
            result, error = answers.get(timeout=TIMEOUT_S)
            if error is not None:
                raise error
            right += bool(
                int(result.as_numpy("INDEX")[0]) == index
                and np.all(result.as_numpy("OUTPUT0") == index % 256)
            )
        return right, FLOOD_READ - right
    finally:
        client.stop_stream(cancel_requests=True)


# --- the client threads and processes ----------------------------------------------------------


@dataclass
class ClientContext:
    """What a client thread needs: where to send, when to stop, where to count."""

    grpc_url: str
    http_url: str
    stop: Any  # multiprocessing Event
    errors: Any  # multiprocessing Queue of (time, role, text)
    slot: Slot
    role: Role
    tag: str  # unique prefix of this thread's regions


def guarded(context: ClientContext, work: Callable[[], tuple[int, int]]) -> None:
    """Run one unit of work; count right and wrong answers, report an error's text."""
    try:
        right, wrong = work()
    except Exception as exc:  # every failure is counted and classified by the parent
        context.slot.add("errors")
        context.errors.put((time.time(), context.role.name, f"{type(exc).__name__}: {exc}"[:300]))
        return
    context.slot.add("ok", right)
    context.slot.add("wrong", wrong)


def repeat(context: ClientContext, work: Callable[[int], tuple[int, int]]) -> None:
    """Run ``work(n)`` for n = 1, 2, ... under ``guarded`` until the run stops."""
    n = 0
    while not context.stop.is_set():
        n += 1
        guarded(context, lambda n=n: work(n))


def run_small(context: ClientContext) -> None:
    client = make_client(context.role.protocol, url_of(context))
    rng = np.random.default_rng()
    protocol = context.role.protocol
    repeat(context, lambda _: (1, 0) if small_request(client, protocol, rng) else (0, 1))


def run_wire(context: ClientContext) -> None:
    client = make_client(context.role.protocol, url_of(context))
    data = np.random.default_rng().random(LARGE, dtype=np.float32)
    repeat(context, lambda stamp: wire_work(client, context.role.protocol, data, stamp))


def wire_work(client: Any, protocol: str, data: np.ndarray, stamp: int) -> tuple[int, int]:
    return (1, 0) if wire_request(client, protocol, data, stamp) else (0, 1)


def run_shm(context: ClientContext) -> None:
    client = make_client(context.role.protocol, url_of(context))
    data = np.random.default_rng().random(LARGE, dtype=np.float32)
    repeat(context, lambda cycle: shm_cycle(client, context.role.protocol,
                                            f"{context.tag}_{cycle}", data))  # fmt: skip


def shm_cycle(client: Any, protocol: str, tag: str, data: np.ndarray) -> tuple[int, int]:
    """Register two regions, send SHM_REQUESTS through them, unregister and destroy them."""
    import tritonclient.utils.shared_memory as shm

    right = 0
    with shm_regions(client, tag) as regions:
        shm.set_shared_memory_region(regions[0], [data])
        for stamp in range(1, SHM_REQUESTS + 1):
            right += shm_request(client, protocol, tag, regions, data, stamp)
    return right, SHM_REQUESTS - right


def run_stream(context: ClientContext) -> None:
    client = make_client("grpc", context.grpc_url)
    rng = np.random.default_rng()
    cycle = 0
    while not context.stop.is_set():
        cycle += 1
        if cycle % 4 == 0:
            guarded(context, lambda: cancelled_flood(client))
            context.slot.add("cancelled")
        else:
            guarded(context, lambda: stream_of_add_sub(client, rng))


RUNNERS: dict[str, Callable[[ClientContext], None]] = {
    "small": run_small,
    "wire": run_wire,
    "shm": run_shm,
    "stream": run_stream,
}


def url_of(context: ClientContext) -> str:
    return context.grpc_url if context.role.protocol == "grpc" else context.http_url


def client_main(
    number: int, urls: tuple[str, str], stop: Any, errors: Any, counters: SynchronizedArray[Any]
) -> None:
    """One client process: THREADS threads, each a fixed role, until ``stop`` is set."""
    threads = []
    for thread in range(THREADS):
        index = number * THREADS + thread
        context = ClientContext(
            urls[0],
            urls[1],
            stop,
            errors,
            Slot(counters, index),
            role_of(number, thread),
            f"soak_{os.getpid()}_{thread}",
        )
        threads.append(threading.Thread(target=RUNNERS[context.role.kind], args=(context,)))
        threads[-1].start()
    for thread_ in threads:
        thread_.join()
    errors.close()
    errors.join_thread()


def victim_main(grpc_url: str, tag: str, counters: SynchronizedArray[Any], index: int) -> None:
    """A client that registers two regions and sends through them until it is killed."""
    import tritonclient.grpc as grpcclient
    import tritonclient.utils.shared_memory as shm

    client = grpcclient.InferenceServerClient(grpc_url)
    data = np.random.default_rng().random(LARGE, dtype=np.float32)
    slot = Slot(counters, index)
    regions = [
        shm.create_shared_memory_region(f"{tag}_{n}", f"/{tag}_{n}", LARGE_BYTES)
        for n in ("in", "out")
    ]
    for name in ("in", "out"):
        client.register_system_shared_memory(f"{tag}_{name}", f"/{tag}_{name}", LARGE_BYTES)
    shm.set_shared_memory_region(regions[0], [data])
    stamp = 0
    while True:
        stamp += 1
        try:
            right = shm_request(client, "grpc", tag, (regions[0], regions[1]), data, stamp)
            slot.add("ok" if right else "wrong")
        except Exception:  # its requests are the killed client's: counted, not reported
            slot.add("errors")


# --- what the server holds ------------------------------------------------------------------


@dataclass
class Usage:
    """One process group's holdings: RSS (MiB), open fds, threads, /dev/shm objects."""

    rss_mib: float = 0.0
    fds: int = 0
    threads: int = 0
    shm_objects: int = 0


def shm_objects(pid: int) -> set[str]:
    """The /dev/shm objects a process maps or holds open (deleted ones too)."""
    found: set[str] = set()
    with contextlib.suppress(OSError):
        with open(f"/proc/{pid}/maps") as maps:
            found |= {line.split(maxsplit=5)[-1].strip() for line in maps if "/dev/shm/" in line}
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("/dev/shm/"):
                    found.add(target)
    return {name.removesuffix(" (deleted)") for name in found}


def usage_of(processes: list[psutil.Process]) -> Usage:
    """The sum over ``processes`` (the /dev/shm objects counted once)."""
    usage, objects = Usage(), set()
    for process in processes:
        with contextlib.suppress(psutil.Error):
            usage.rss_mib += process.memory_info().rss / 2**20
            usage.fds += process.num_fds()
            usage.threads += process.num_threads()
            objects |= shm_objects(process.pid)
    usage.shm_objects = len(objects)
    return usage


def snapshot(server_pid: int) -> dict[str, Usage]:
    """The server process, and its workers together."""
    server = psutil.Process(server_pid)
    return {"server": usage_of([server]), "workers": usage_of(server.children(recursive=True))}


@dataclass
class Sampler:
    """Samples the server every SAMPLE_S seconds in a thread; keeps each figure's peak."""

    server_pid: int
    peak: dict[str, Usage] = field(default_factory=lambda: {"server": Usage(), "workers": Usage()})
    stop: threading.Event = field(default_factory=threading.Event)
    rss_series: list[tuple[float, float, float]] = field(default_factory=list)  # t, server, workers

    def run(self) -> None:
        begin = time.monotonic()
        while not self.stop.wait(SAMPLE_S):
            with contextlib.suppress(psutil.Error):
                sample = snapshot(self.server_pid)
                self.add(sample)
                self.rss_series.append(
                    (time.monotonic() - begin, sample["server"].rss_mib, sample["workers"].rss_mib)
                )

    def quarters(self) -> list[tuple[float, float, float]]:
        """The samples at the end of each quarter of the load (to tell growth from a plateau)."""
        if not self.rss_series:
            return []
        last = self.rss_series[-1][0]
        return [min(self.rss_series, key=lambda s: abs(s[0] - last * q / 4)) for q in (1, 2, 3, 4)]

    def add(self, sample: dict[str, Usage]) -> None:
        for group, usage in sample.items():
            peak = self.peak[group]
            for name in asdict(usage):
                setattr(peak, name, max(getattr(peak, name), getattr(usage, name)))


# --- faults ---------------------------------------------------------------------------------


@dataclass
class Fault:
    """One injected fault: when (wall-clock), what, and what followed."""

    kind: str
    start: float
    end: float = 0.0
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class Soak:
    """The running soak: the server, the shared counters, the faults so far."""

    server: _triton.RunningServer
    counters: SynchronizedArray[Any]
    context: Any  # the spawn context
    fault_every: float
    slow_hold: float
    faults: list[Fault] = field(default_factory=list)
    victims: int = 0


def kill_worker(soak: Soak, fault: Fault) -> None:
    """SIGKILL one worker (in turn); wait for its replacement, then for every model's ready."""
    server = psutil.Process(soak.server.process.pid)
    workers = sorted(server.children(), key=lambda p: p.pid)
    victim = workers[len(soak.faults) % len(workers)]
    fault.detail["pid"] = victim.pid
    victim.send_signal(signal.SIGKILL)
    before = {worker.pid for worker in workers}
    deadline = time.monotonic() + 60.0
    while time.monotonic() < deadline:
        new = [p.pid for p in server.children() if p.pid not in before and p.is_running()]
        if new and "new_pid" not in fault.detail:
            fault.detail["new_pid"] = new[0]
            fault.detail["restarted_after_s"] = round(time.time() - fault.start, 2)
        if new and all(model_ready(soak.server.http_url, model.name) for model in MODELS):
            fault.detail["ready_after_s"] = round(time.time() - fault.start, 2)
            return
        time.sleep(0.05)
    fault.detail["ready_after_s"] = None  # not ready again within a minute


def model_ready(http_url: str, model: str) -> bool:
    """Whether GET /v2/models/<model>/ready answers 200."""
    url = f"http://{http_url}/v2/models/{model}/ready"
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
            return bool(response.status == 200)
    except OSError:  # 400/503 (HTTPError), refused, timed out
        return False


def kill_client(soak: Soak, fault: Fault) -> None:
    """Start a client that holds two regions, SIGKILL it mid-request, await the reclaim."""
    index = PROCESSES * THREADS + soak.victims % VICTIM_SLOTS
    soak.victims += 1
    tag = f"soak_victim_{soak.victims}_{os.getpid()}"
    process = soak.context.Process(
        target=victim_main, args=(soak.server.grpc_url, tag, soak.counters, index)
    )
    process.start()
    deadline = time.monotonic() + 60.0
    while counter(soak.counters, index, "ok") < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    fault.start = time.time()
    process.kill()
    process.join()
    fault.detail["reclaimed_after_s"] = wait_unregistered(soak.server.http_url, tag)
    left = [name for name in os.listdir("/dev/shm") if name.startswith(tag)]
    for name in left:  # the client's own objects: its supervisor's to remove, not the server's
        shared_memory.SharedMemory(f"/{name}").unlink()  # the resource tracker knows it
    fault.detail["client_objects_removed"] = len(left)


def wait_unregistered(http_url: str, tag: str, timeout_s: float = 30.0) -> float | None:
    """Seconds until no registered region's name starts with ``tag`` (None: not in time)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if not [name for name in registered_regions(http_url) if name.startswith(tag)]:
            return round(time.monotonic() - start, 3)
        time.sleep(0.05)
    return None


def registered_regions(http_url: str) -> list[str]:
    """The names of the registered system shared-memory regions."""
    url = f"http://{http_url}/v2/systemsharedmemory/status"
    with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
        return [region["name"] for region in json.load(response)]


def cancel_streams(soak: Soak, fault: Fault) -> None:
    """A burst of 8 flood streams, each read for FLOOD_READ responses and cancelled."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(soak.server.grpc_url)
    results = []
    for _ in range(8):
        try:
            results.append(cancelled_flood(client))
        except Exception as exc:  # reported in the fault's detail
            fault.detail.setdefault("errors", []).append(str(exc)[:200])
    client.close()
    fault.detail["right"] = sum(right for right, _ in results)
    fault.detail["wrong"] = sum(wrong for _, wrong in results)


def slow_readers(soak: Soak, fault: Fault, hold_s: float, megabytes: int = 16) -> None:
    """Two raw HTTP clients ask for a ``megabytes`` output, read nothing, then close."""
    sockets = [slow_request(soak.server.http_port, megabytes) for _ in range(2)]
    time.sleep(hold_s)
    fault.detail["server_rss_mib_held"] = round(
        snapshot(soak.server.process.pid)["server"].rss_mib, 1
    )
    for sock in sockets:
        sock.close()


def slow_request(port: int, megabytes: int) -> socket.socket:
    """A connection that has sent an identity_4mb request and will read nothing."""
    elements = megabytes * 2**20 // 4
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "INPUT0",
                    "shape": [elements],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": elements * 4},
                }
            ],
            "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}],
        }
    ).encode()
    body = header + np.ones(elements, np.float32).tobytes()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    head = (
        f"POST /v2/models/identity_4mb/infer HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/octet-stream\r\n"
        f"Inference-Header-Content-Length: {len(header)}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    return sock


def run_faults(soak: Soak, stop: threading.Event) -> None:
    """One fault every ``soak.fault_every`` seconds, the kinds in turn, until ``stop``."""
    kinds: list[Callable[[Soak, Fault], None]] = [
        kill_worker,
        kill_client,
        cancel_streams,
        lambda soak, fault: slow_readers(soak, fault, soak.slow_hold),
    ]
    names = ("worker_kill", "client_kill", "stream_cancel", "slow_reader")
    while not stop.wait(soak.fault_every):
        turn = len(soak.faults) % len(kinds)
        fault = Fault(names[turn], time.time())
        try:
            kinds[turn](soak, fault)
        except Exception as exc:  # a fault that could not be injected is reported as such
            fault.detail["failed"] = f"{type(exc).__name__}: {exc}"[:300]
        fault.end = time.time()
        soak.faults.append(fault)
        print(f"# fault {fault.kind}: {fault.detail}", file=sys.stderr)


# --- errors ---------------------------------------------------------------------------------


def classify(error: tuple[float, str, str], faults: list[Fault]) -> str:
    """``allowed`` for a lost-instance error in a worker kill's window; else ``unexpected``."""
    when, _, text = error
    for fault in faults:
        if fault.kind != "worker_kill" or not any(part in text for part in LOST_INSTANCE):
            continue
        ready = fault.detail.get("ready_after_s") or TIMEOUT_S
        if fault.start - 1.0 <= when <= fault.start + ready + WORKER_KILL_GRACE_S:
            return "allowed"
    return "unexpected"


def drain(errors: Any, into: list[tuple[float, str, str]], stop: threading.Event) -> None:
    """Move the clients' error reports into a list (so that no client blocks on the pipe)."""
    while not stop.is_set() or not errors.empty():
        with contextlib.suppress(queue.Empty):
            into.append(errors.get(timeout=0.2))


# --- the run --------------------------------------------------------------------------------


def counter(counters: SynchronizedArray[Any], index: int, name: str) -> int:
    return int(counters[index * len(FIELDS) + FIELDS.index(name)])


def warm_up(server: _triton.RunningServer) -> None:
    """Each kind of request once from this process, then its clients closed."""
    rng = np.random.default_rng()
    data = np.random.default_rng().random(LARGE, dtype=np.float32)
    for protocol in ("grpc", "http"):
        client = make_client(protocol, server.grpc_url if protocol == "grpc" else server.http_url)
        assert small_request(client, protocol, rng) and wire_request(client, protocol, data, 1)
        assert shm_cycle(client, protocol, f"soak_warmup_{os.getpid()}_{protocol}", data)[1] == 0
        if protocol == "grpc":
            assert stream_of_add_sub(client, rng)[1] == 0 and cancelled_flood(client)[1] == 0
        client.close()


def load(soak: Soak, duration: float, sampler: Sampler) -> list[tuple[float, str, str]]:
    """The clients and the faults for ``duration`` seconds; the clients' error reports."""
    stop, errors = soak.context.Event(), soak.context.Queue()
    urls = (soak.server.grpc_url, soak.server.http_url)
    processes = [
        soak.context.Process(target=client_main, args=(n, urls, stop, errors, soak.counters))
        for n in range(PROCESSES)
    ]
    reports: list[tuple[float, str, str]] = []
    done = threading.Event()
    threads = [
        threading.Thread(target=drain, args=(errors, reports, done)),
        threading.Thread(target=run_faults, args=(soak, done)),
        threading.Thread(target=sampler.run),
    ]
    for process in processes:
        process.start()
    for thread in threads:
        thread.start()
    time.sleep(duration)
    stop.set()
    done.set()
    for process in processes:
        process.join(TIMEOUT_S * 2)
        if process.is_alive():  # a client stuck past every deadline: a hang to report
            reports.append((time.time(), "client", f"process {process.pid} did not stop"))
            process.kill()
    sampler.stop.set()
    for thread in threads:
        thread.join()
    return reports


def served_by_role(counters: SynchronizedArray[Any]) -> dict[str, dict[str, int]]:
    """Each role's counters, summed over its threads; the killed clients' apart."""
    table: dict[str, dict[str, int]] = collections.defaultdict(lambda: dict.fromkeys(FIELDS, 0))
    for process in range(PROCESSES):
        for thread in range(THREADS):
            row = table[role_of(process, thread).name]
            for name in FIELDS:
                row[name] += counter(counters, process * THREADS + thread, name)
    for index in range(PROCESSES * THREADS, PROCESSES * THREADS + VICTIM_SLOTS):
        for name in FIELDS:
            table["shm/grpc (killed clients)"][name] += counter(counters, index, name)
    return dict(sorted(table.items()))


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start the server, warm up, soak, settle; everything the report needs."""
    with (
        tempfile.TemporaryDirectory(prefix="soak-") as folder,
        _triton.run_dlserve(
            make_repository(Path(folder)), *_triton.free_ports(3), *args.dlserve_args.split()
        ) as server,
    ):
        pid = server.process.pid
        warm_up(server)
        time.sleep(args.settle)
        idle, idle_threads = snapshot(pid), thread_names(pid)
        warm = phase(server, args, args.warmup, max(args.warmup / 5, 1.0))
        time.sleep(args.settle)
        start, start_threads = snapshot(pid), thread_names(pid)
        soak = phase(server, args, args.duration, args.fault_every)
        time.sleep(args.settle)
        end, end_threads = snapshot(pid), thread_names(pid)
        return {
            "version": server_version(server),
            "warmup": warm,
            **soak,
            "idle": idle,
            "start": start,
            "end": end,
            "server_threads": {"idle": idle_threads, "start": start_threads, "end": end_threads},
            "regions_left": registered_regions(server.http_url),
            "server_alive_at_end": server.process.poll() is None,
        }


def phase(
    server: _triton.RunningServer, args: argparse.Namespace, duration: float, fault_every: float
) -> dict[str, Any]:
    """The load and the faults for ``duration`` seconds, counted on their own."""
    context = multiprocessing.get_context("spawn")
    counters = context.Array("q", (PROCESSES * THREADS + VICTIM_SLOTS) * len(FIELDS), lock=False)
    soak = Soak(server, counters, context, fault_every, args.slow_hold)
    sampler = Sampler(server.process.pid)
    sampler.add(snapshot(server.process.pid))
    reports = load(soak, duration, sampler)
    return {
        "roles": served_by_role(counters),
        "errors": reports,
        "faults": soak.faults,
        "peak": sampler.peak,
        "rss_quarters": sampler.quarters(),
    }


def thread_names(pid: int) -> dict[str, int]:
    """How many of a process's threads bear each name."""
    names: collections.Counter[str] = collections.Counter()
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/comm") as comm:
            names[comm.read().strip()] += 1
    return dict(names)


def make_repository(folder: Path) -> Path:
    """A model repository holding copies of MODELS."""
    for model in MODELS:
        shutil.copytree(model, folder / model.name)
    return folder


def server_version(server: _triton.RunningServer) -> str:
    """``name version`` from the server metadata endpoint (GET /v2)."""
    with urllib.request.urlopen(f"http://{server.http_url}/v2", timeout=5.0) as response:
        metadata = json.load(response)
    return f"{metadata.get('name', '?')} {metadata.get('version', '?')}"


# --- output ---------------------------------------------------------------------------------


def within(start: float, end: float) -> bool:
    """End at most TOLERANCE above start (below is memory given back, not a leak)."""
    return end <= (1 + TOLERANCE) * start


def resource_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per process group and figure: idle, start, peak, end, and whether end is near start."""
    rows = []
    for group in ("server", "workers"):
        for name in asdict(Usage()):
            row: dict[str, Any] = {"process": group, "figure": name}
            for key in ("idle", "start", "peak", "end"):
                row[key] = getattr(result[key][group], name)
            rows.append(row | {"pass": within(row["start"], row["end"])})
    return rows


def error_summary(errors: list[tuple[float, str, str]], faults: list[Fault]) -> dict[str, Any]:
    """Errors by class, and the most frequent texts of each class."""
    classes: dict[str, collections.Counter[str]] = {
        "allowed": collections.Counter(),
        "unexpected": collections.Counter(),
    }
    for error in errors:
        classes[classify(error, faults)][f"{error[1]}: {error[2]}"] += 1
    return {
        name: {"count": sum(texts.values()), "texts": dict(texts.most_common(8))}
        for name, texts in classes.items()
    }


def totals(roles: dict[str, dict[str, int]]) -> dict[str, int]:
    """The load's counters summed over its roles (the killed clients' apart)."""
    rows = [row for role, row in roles.items() if "killed" not in role]
    return {name: sum(row[name] for row in rows) for name in FIELDS}


def print_requests(result: dict[str, Any], summary: dict[str, Any]) -> None:
    print(f"{'requests':<28} {'served':>9} {'wrong':>6} {'errors':>7} {'cancelled':>9}")
    for role, row in [
        *result["roles"].items(),
        ("total (killed clients apart)", totals(result["roles"])),
    ]:
        print(
            f"{role:<28} {row['ok']:>9} {row['wrong']:>6} {row['errors']:>7} {row['cancelled']:>9}"
        )
    for name, part in summary.items():
        print(f"errors {name}: {part['count']}")
        for text, count in part["texts"].items():
            print(f"  {count:>6}  {text}")
    for fault in result["faults"]:
        print(f"fault {fault.kind:<14} {fault.detail}")


def print_resources(result: dict[str, Any]) -> None:
    quarters = ", ".join(f"{t:.0f} s: {a:.0f} / {b:.0f}" for t, a, b in result["rss_quarters"])
    print(f"RSS MiB under load, server / workers: {quarters}")
    print(f"server threads by name: {result['server_threads']}")
    print(
        f"{'process':<8} {'figure':<12} {'idle':>7} {'start':>7} {'peak':>7} {'end':>7}  "
        "end <= start + 10 %"
    )
    for row in resource_rows(result):
        figures = " ".join(f"{row[key]:>7.0f}" for key in ("idle", "start", "peak", "end"))
        verdict = "pass" if row["pass"] else "FAIL"
        print(f"{row['process']:<8} {row['figure']:<12} {figures}  {verdict}")


def print_report(result: dict[str, Any], summary: dict[str, Any]) -> None:
    """The soak's requests, errors, faults and resources; the warm-up in one line."""
    warm = result["warmup"]
    warm_errors = error_summary(warm["errors"], warm["faults"])["unexpected"]["count"]
    counts = totals(warm["roles"])
    print(f"# {result['version']}")
    print(
        f"warm-up: {counts['ok']} served, {counts['wrong']} wrong, {warm_errors} unexpected "
        f"errors, faults {[fault.kind for fault in warm['faults']]}"
    )
    print_requests(result, summary)
    print(
        f"regions left registered: {len(result['regions_left'])}; "
        f"server alive: {result['server_alive_at_end']}"
    )
    print_resources(result)


def write_json(
    path: Path, args: argparse.Namespace, result: dict[str, Any], summary: dict[str, Any]
) -> None:
    """The results and the conditions they were measured under."""
    warm = result["warmup"]
    document = {
        "benchmark": "soak",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "settings": {
            "duration_s": args.duration,
            "warmup_s": args.warmup,
            "fault_every_s": args.fault_every,
            "settle_s": args.settle,
            "slow_hold_s": args.slow_hold,
            "clients": PROCESSES * THREADS,
            "processes": PROCESSES,
        },
        "server": result["version"],
        "warmup": {
            "requests": warm["roles"],
            "errors": error_summary(warm["errors"], warm["faults"]),
            "faults": [asdict(fault) for fault in warm["faults"]],
        },
        "requests": result["roles"],
        "errors": summary,
        "faults": [asdict(fault) for fault in result["faults"]],
        "regions_left_registered": result["regions_left"],
        "server_alive_at_end": result["server_alive_at_end"],
        "resources": resource_rows(result),
        "server_threads": result["server_threads"],
        "rss_mib_by_quarter": [
            {"t_s": t, "server": a, "workers": b} for t, a, b in result["rss_quarters"]
        ],
    }
    path.write_text(json.dumps(document, indent=2) + "\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    parser.add_argument(
        "--warmup",
        type=float,
        default=60.0,
        help="seconds of the same load and each fault once, before the start reading",
    )
    parser.add_argument("--fault-every", type=float, default=30.0, help="seconds between faults")
    parser.add_argument(
        "--settle", type=float, default=10.0, help="seconds before the start and end readings"
    )
    parser.add_argument(
        "--slow-hold", type=float, default=10.0, help="seconds a slow reader keeps its connection"
    )
    parser.add_argument("--dlserve-args", default="", help="more `dlserve serve` options")
    parser.add_argument("--json", type=Path, help="also write the results here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = run(args)
    summary = error_summary(result["errors"], result["faults"])
    print_report(result, summary)
    if args.json is not None:
        write_json(args.json, args, result, summary)


if __name__ == "__main__":
    main()
