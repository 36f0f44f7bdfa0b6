"""The server reclaims the regions of client processes that die.

A client process (``shm_owner.py``, unmodified tritonclient) registers system shared-memory
regions over gRPC, HTTP or gRPC on a Unix socket and is killed with SIGKILL: within 5 s the
server's status lists none of its regions, no worker maps them any more, the metric counts
them, and a living client's region stays; a region in use when its owner dies stays until
its request ends (reclaim is an unregister); on a Unix socket with several clients the
SDK's confirmed pid claim names the owner. ``--shm-idle-timeout`` drops unused regions.
Observables are the status API and /proc/*/maps, polled with a deadline.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
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

from conftest import EXAMPLES, TEST_MODELS, RunningServer, run_server

OWNER = Path(__file__).with_name("shm_owner.py")
RECLAIM_DEADLINE_S = 5.0


@pytest.fixture(scope="module")
def uds_dir() -> Iterator[str]:
    directory = tempfile.mkdtemp(prefix="dls")  # short: a socket path has 108 bytes at most
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, uds_dir: str) -> Iterator[RunningServer]:
    repository = tmp_path_factory.mktemp("reclaim_repo")
    shutil.copytree(EXAMPLES / "add_sub", repository / "add_sub")
    shutil.copytree(TEST_MODELS / "gated", repository / "gated")
    with run_server(repository, "--grpc-uds", f"{uds_dir}/grpc.sock") as running:
        yield running


def url_of(server: RunningServer, transport: str, uds_dir: str) -> tuple[str, str]:
    if transport == "uds":
        return "grpc", f"unix:{uds_dir}/grpc.sock"
    return transport, server.grpc_url if transport == "grpc" else server.http_url


def registered(server: RunningServer) -> set[str]:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        return set(client.get_system_shared_memory_status().regions)
    finally:
        client.close()


def wait_until(done: Callable[[], bool], deadline_s: float) -> float:
    """Poll ``done`` until it holds; the seconds it took. Fails at the deadline."""
    start = time.monotonic()
    while not done():
        elapsed = time.monotonic() - start
        assert elapsed < deadline_s, f"not done within {deadline_s} s"
        time.sleep(0.02)  # polling interval of an observable with no event to wait on
    return time.monotonic() - start


def reclaimed_metric(server: RunningServer, reason: str) -> float:
    text = urllib.request.urlopen(server.metrics_url).read().decode()
    found = re.search(rf'^dlserve_shm_regions_reclaimed_total{{reason="{reason}"}} (\S+)$',
                      text, re.M)  # fmt: skip
    assert found, text
    return float(found.group(1))


@contextlib.contextmanager
def owner_process(protocol: str, url: str, count: int) -> Iterator[Owner]:
    """A client process that registered ``count`` regions (its handshake line says which);
    killed, waited for and its objects removed at the end."""
    process = subprocess.Popen(
        [sys.executable, str(OWNER), protocol, url, str(count)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    with process:
        assert process.stdout is not None
        line = process.stdout.readline()  # the handshake: its regions are registered
        assert line, f"the owner exited with {process.wait()}"
        said = json.loads(line)
        try:
            yield Owner(process, said["names"], said["keys"])
        finally:
            process.kill()
            process.wait()
            for key in said["keys"]:
                Path(f"/dev/shm{key}").unlink(missing_ok=True)


@dataclass
class Owner:
    process: subprocess.Popen[str]
    names: list[str]
    keys: list[str]


def mapping_processes(server: RunningServer, key: str) -> list[int]:
    root = psutil.Process(server.process.pid)
    pids = [root.pid] + [p.pid for p in root.children(recursive=True)]
    path = f"/dev/shm/{key.lstrip('/')}"
    return [pid for pid in pids if path in Path(f"/proc/{pid}/maps").read_text()]


@pytest.mark.parametrize("transport", ["grpc", "http", "uds"])
def test_killed_client_regions_are_reclaimed(
    server: RunningServer, uds_dir: str, transport: str
) -> None:
    protocol, url = url_of(server, transport, uds_dir)
    before = reclaimed_metric(server, "owner_exit")
    # a living client's region, which must stay
    key = f"/reclaim_keep_{uuid.uuid4().hex}"
    fd = os.open(f"/dev/shm{key}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, 64)
    os.close(fd)
    api = grpcclient.InferenceServerClient(server.grpc_url)
    api.register_system_shared_memory("keep", key, 64)
    try:
        with owner_process(protocol, url, 3) as owner:
            assert set(owner.names) <= registered(server)
            # a worker maps the owner's first region: a request uses it
            x = np.arange(16, dtype=np.float32)
            Path(f"/dev/shm{owner.keys[0]}").write_bytes(x.tobytes() + bytes(4096 - 64))
            inputs = [grpcclient.InferInput(n, [16], "FP32") for n in ("INPUT0", "INPUT1")]
            inputs[0].set_shared_memory(owner.names[0], 64)
            inputs[1].set_data_from_numpy(x)
            result = api.infer("add_sub", inputs)
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), 2 * x)
            assert mapping_processes(server, owner.keys[0])

            owner.process.send_signal(signal.SIGKILL)
            owner.process.wait()
            names = set(owner.names)
            took = wait_until(lambda: not names & registered(server), RECLAIM_DEADLINE_S)
            unmapped = wait_until(lambda: not mapping_processes(server, owner.keys[0]), 2.0)
            print(f"{transport}: status clear {took:.3f} s after SIGKILL, "
                  f"worker unmapped {unmapped:.3f} s later")  # fmt: skip
        assert "keep" in registered(server)
        assert reclaimed_metric(server, "owner_exit") == before + 3
        assert server.alive()
    finally:
        api.unregister_system_shared_memory("keep")
        api.close()
        Path(f"/dev/shm{key}").unlink(missing_ok=True)


def test_client_that_exits_normally_without_unregistering(
    server: RunningServer, uds_dir: str
) -> None:
    """Closing stdin ends the owner cleanly (no unregister): its regions go the same way."""
    with owner_process("grpc", server.grpc_url, 1) as owner:
        assert owner.process.stdin is not None
        owner.process.stdin.close()
        assert owner.process.wait() == 0
        wait_until(lambda: owner.names[0] not in registered(server), RECLAIM_DEADLINE_S)


def test_grpc_over_unix_socket(server: RunningServer, uds_dir: str) -> None:
    """tritonclient reaches the Unix socket with 'unix:PATH', and may run inference there."""
    client = grpcclient.InferenceServerClient(f"unix:{uds_dir}/grpc.sock")
    try:
        x = np.ones(4, dtype=np.float32)
        inputs = [grpcclient.InferInput(n, [4], "FP32") for n in ("INPUT0", "INPUT1")]
        for each in inputs:
            each.set_data_from_numpy(x)
        np.testing.assert_array_equal(client.infer("add_sub", inputs).as_numpy("OUTPUT1"), 0 * x)
    finally:
        client.close()


def test_idle_regions_are_dropped(tmp_path: Path) -> None:
    shutil.copytree(EXAMPLES / "add_sub", tmp_path / "add_sub")
    key = f"/reclaim_idle_{uuid.uuid4().hex}"
    fd = os.open(f"/dev/shm{key}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, 64)
    os.close(fd)
    try:
        with run_server(tmp_path, "--shm-idle-timeout", "0.5") as server:
            client = httpclient.InferenceServerClient(server.http_url)
            client.register_system_shared_memory("idle", key, 64)
            took = wait_until(lambda: "idle" not in registered(server), RECLAIM_DEADLINE_S)
            assert took >= 0.4  # not before its time (the status call itself does not use it)
            assert reclaimed_metric(server, "idle") == 1
            client.close()
    finally:
        Path(f"/dev/shm{key}").unlink(missing_ok=True)


BYSTANDER = (
    "import sys, tritonclient.grpc as g; c = g.InferenceServerClient(sys.argv[1]); "
    "assert c.is_server_live(); print('connected', flush=True); sys.stdin.read()"
)
SDK_OWNER = Path(__file__).parent.parent / "client" / "sdk_process.py"


def test_uds_with_several_clients_believes_a_confirmed_claim(
    server: RunningServer, uds_dir: str
) -> None:
    """Two processes on the socket: gRPC cannot say which one registered, but the SDK says
    its pid (dlserve-client-pid) and the server confirms it is one of the socket's peers."""
    url = f"unix:{uds_dir}/grpc.sock"
    with subprocess.Popen(
        [sys.executable, "-c", BYSTANDER, url], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    ) as bystander:
        assert bystander.stdout is not None
        assert bystander.stdout.readline().strip() == b"connected"
        with subprocess.Popen(
            [sys.executable, str(SDK_OWNER), url, "hang"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        ) as owner:  # fmt: skip
            assert owner.stdout is not None
            names = set(json.loads(owner.stdout.readline())["regions"])
            assert names and names <= registered(server)
            owner.send_signal(signal.SIGKILL)
            owner.wait()
        wait_until(lambda: not names & registered(server), RECLAIM_DEADLINE_S)
        bystander.kill()
    for name in names:
        Path(f"/dev/shm/{name}").unlink(missing_ok=True)


def test_uds_with_several_unmodified_clients_knows_whose_region_it_is(
    server: RunningServer, uds_dir: str
) -> None:
    """Two tritonclient processes on the socket, neither saying its pid: the register call's
    own connection names its process (SO_PEERCRED), so the killed one's region goes and
    the other's stays."""
    url = f"unix:{uds_dir}/grpc.sock"
    with (
        subprocess.Popen(
            [sys.executable, "-c", BYSTANDER, url], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        ) as bystander,
        owner_process("grpc", url, 1) as survivor,
    ):
        assert bystander.stdout is not None
        assert bystander.stdout.readline().strip() == b"connected"
        with owner_process("grpc", url, 1) as doomed:
            assert set(doomed.names + survivor.names) <= registered(server)
            doomed.process.send_signal(signal.SIGKILL)
            doomed.process.wait()
            wait_until(lambda: doomed.names[0] not in registered(server), RECLAIM_DEADLINE_S)
        assert survivor.names[0] in registered(server)
        bystander.kill()


def test_a_region_in_use_when_its_owner_dies_goes_when_the_request_ends(
    server: RunningServer, tmp_path: Path
) -> None:
    """Reclaim is an unregister: a request in flight keeps its region until it ends."""
    started, go = tmp_path / "started", tmp_path / "go"
    for fifo in (started, go):
        os.mkfifo(fifo)
    api = grpcclient.InferenceServerClient(server.grpc_url)
    results: queue.Queue[Any] = queue.Queue()
    with owner_process("grpc", server.grpc_url, 1) as owner:
        data = np.arange(16, dtype=np.float32)
        Path(f"/dev/shm{owner.keys[0]}").write_bytes(data.tobytes() + bytes(4096 - 64))
        control = np.array([str(started).encode(), str(go).encode()], dtype=np.object_)
        inputs = [grpcclient.InferInput("CONTROL", [2], "BYTES"),
                  grpcclient.InferInput("DATA", [16], "FP32")]  # fmt: skip
        inputs[0].set_data_from_numpy(control)
        inputs[1].set_shared_memory(owner.names[0], 64)
        api.async_infer("gated", inputs, lambda result, error: results.put(error or result))
        with open(started) as fifo:  # execute has begun: the region is in use
            assert fifo.readline() == "started\n"
        before = reclaimed_metric(server, "owner_exit")
        owner.process.send_signal(signal.SIGKILL)
        owner.process.wait()
        wait_until(lambda: reclaimed_metric(server, "owner_exit") == before + 1, RECLAIM_DEADLINE_S)
        assert owner.names[0] in registered(server)  # reclaimed, but still in use
        with open(go, "w") as fifo:
            fifo.write("go\n")
        result = results.get(timeout=RECLAIM_DEADLINE_S)
        assert not isinstance(result, Exception), result
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), data * 2)
        wait_until(lambda: owner.names[0] not in registered(server), RECLAIM_DEADLINE_S)
    api.close()


def test_grpc_uds_replaces_a_stale_socket_but_nothing_else(tmp_path: Path, uds_dir: str) -> None:
    shutil.copytree(EXAMPLES / "add_sub", tmp_path / "add_sub")
    stale = f"{uds_dir}/stale.sock"
    with socket.socket(socket.AF_UNIX) as dead:  # a server that died left its socket file
        dead.bind(stale)
    with run_server(tmp_path, "--grpc-uds", stale):
        client = grpcclient.InferenceServerClient(f"unix:{stale}")
        assert client.is_server_live()
        client.close()
    regular = Path(f"{uds_dir}/regular")
    regular.write_text("not a socket")
    with (
        pytest.raises(RuntimeError, match="exited during startup"),
        run_server(tmp_path, "--grpc-uds", str(regular)),
    ):
        pass
    assert regular.read_text() == "not a socket"
