"""Who owns a region, and reclaiming it when its owner exits, without a server.

- procfs: the process at the other end of a real loopback TCP connection, this process's
  own and a child's (a Unix socket's peer is told by the frontend: SO_PEERCRED);
- RegionOwners: a child process's exit, seen through its pidfd, unregisters its regions
  (in use: once the request ends) and counts them; the polling fallback does the same;
  a claimed pid is believed only when the OS confirms it; idle regions are dropped;
- RegionRegistry.reclaim / drop_idle: regions owned by several processes go with the last.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from dlserve.server.core.host import procfs
from dlserve.server.core.shm import owners as owners_module
from dlserve.server.core.shm.owners import OwnerOptions, RegionOwners
from dlserve.server.core.shm.registry import RegionRegistry
from dlserve.types import InferRequest, InputTensor, Peer, RegionRef

LOCAL = Peer("127.0.0.1")


@pytest.fixture
def key() -> Iterator[str]:
    name = f"test_owners_{uuid.uuid4().hex}"
    path = Path("/dev/shm") / name
    path.write_bytes(bytes(4096))
    yield "/" + name
    path.unlink(missing_ok=True)


def test_tcp_peer_process_is_found() -> None:
    with (
        socket.create_server(("127.0.0.1", 0)) as server,
        socket.create_connection(server.getsockname()) as client,
    ):
        accepted, (address, port) = server.accept()
        with accepted:
            assert client.getsockname() == (address, port)
            assert procfs.tcp_peer_processes(address, port) == {os.getpid()}
    assert procfs.tcp_peer_processes("127.0.0.1", 1) == set()
    assert procfs.tcp_peer_processes("not an address", 1) == set()


def test_tcp6_peer_process_is_found() -> None:
    try:
        server = socket.create_server(("::1", 0), family=socket.AF_INET6)
    except OSError:
        pytest.skip("no IPv6 loopback here")
    with server, socket.create_connection(server.getsockname()[:2]):
        accepted, peer = server.accept()
        with accepted:
            assert procfs.tcp_peer_processes(peer[0], peer[1]) == {os.getpid()}


def test_tcp_peer_in_a_child_process() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        host, port = server.getsockname()
        child = subprocess.Popen(
            [sys.executable, "-c",
             f"import socket,sys; s=socket.create_connection(('{host}',{port})); sys.stdin.read()"],
            stdin=subprocess.PIPE,
        )  # fmt: skip
        with child:
            accepted, peer = server.accept()
            with accepted:
                assert procfs.tcp_peer_processes(*peer) == {child.pid}
            child.kill()


def _request(region: str) -> InferRequest:
    tensor = InputTensor("x", "UINT8", (8,), None, region=RegionRef(region, 8))
    return InferRequest("m", "", "", [tensor], [], peer=LOCAL)


def test_registry_reclaims_with_the_last_owner(key: str) -> None:
    registry = RegionRegistry()
    registry.register("one", key, 0, 64, LOCAL, owners={10})
    registry.register("both", key, 0, 64, LOCAL, owners={10, 11})
    registry.register("nobody", key, 0, 64, LOCAL)
    assert registry.owned() == {10, 11}
    lease = registry.lease(_request("one"))
    assert lease is not None
    assert registry.reclaim(10) == ["one"]  # in use: listed until its request ends
    assert {r.name for r in registry.status()} == {"one", "both", "nobody"}
    registry.release(lease)
    assert {r.name for r in registry.status()} == {"both", "nobody"}
    assert registry.reclaim(11) == ["both"]
    assert registry.reclaim(12) == []
    assert [r.name for r in registry.status()] == ["nobody"]


def test_cuda_regions_are_reclaimed_alike(key: str) -> None:
    registry = RegionRegistry()
    registry.add_cuda("gpu", bytes(64), 0, 1 << 30, owners={10})
    registry.register("host", key, 0, 64, LOCAL, owners={10})
    assert sorted(registry.reclaim(10)) == ["gpu", "host"]
    assert registry.status(cuda=True) == [] and registry.status() == []


def test_registry_drops_idle_regions(key: str) -> None:
    registry = RegionRegistry()
    registry.register("old", key, 0, 64, LOCAL)
    registry.register("busy", key, 0, 64, LOCAL)
    lease = registry.lease(_request("busy"))
    assert lease is not None
    later = time.monotonic() + 1
    assert registry.drop_idle(later) == ["old"]  # a region in use is not idle
    registry.release(lease)
    assert registry.drop_idle(time.monotonic() - 60) == []  # just used
    assert registry.drop_idle(time.monotonic() + 1) == ["busy"]


async def _exit_of_child(owners: RegionOwners, registry: RegionRegistry, key: str) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)  # fmt: skip
    with child:
        registry.register("r", key, 0, 64, LOCAL, owners={child.pid})
        owners.watch([child.pid])
        assert registry.status()
        child.kill()
        child.wait()
    deadline = time.monotonic() + 5
    while registry.status():  # the loop delivers the pidfd's (or the poll's) news
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    assert owners.reclaimed["owner_exit"] == 1


@pytest.mark.parametrize("pidfd", [True, False])
def test_owner_exit_reclaims(key: str, pidfd: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if not pidfd:  # as on a kernel without pidfd_open: polling every 0.5 s
        monkeypatch.delattr(owners_module.os, "pidfd_open")

    async def main() -> None:
        registry = RegionRegistry()
        owners = RegionOwners([registry], OwnerOptions())
        owners.start()
        try:
            await _exit_of_child(owners, registry, key)
        finally:
            await owners.stop()

    asyncio.run(main())


def test_a_dead_owner_is_reclaimed_at_once(key: str) -> None:
    async def main() -> None:
        registry = RegionRegistry()
        owners = RegionOwners([registry], OwnerOptions())
        owners.start()
        child = subprocess.Popen([sys.executable, "-c", "pass"])
        child.wait()
        registry.register("r", key, 0, 64, LOCAL, owners={child.pid})
        owners.watch([child.pid])  # exited before it was watched
        await asyncio.sleep(0)  # one turn of the loop
        assert registry.status() == []
        await owners.stop()

    asyncio.run(main())


def test_claimed_pids_are_checked(tmp_path: Path) -> None:
    async def main() -> None:
        owners = RegionOwners([], OwnerOptions())
        assert await owners.owners_of(None) == set()
        assert await owners.owners_of(Peer("10.0.0.1", 5, 1)) == set()  # remote
        with (
            socket.create_server(("127.0.0.1", 0)) as server,
            socket.create_connection(server.getsockname()),
        ):
            accepted, (address, port) = server.accept()
            with accepted:
                # the only holder is this process, which is the server: nobody
                assert await owners.owners_of(Peer(address, port)) == set()
        assert await owners.owners_of(Peer(None, pid=1)) == set()  # a claim alone: not believed
        assert await owners.owners_of(Peer(None, connection_pid=1)) == {1}  # the socket's word
        assert await owners.owners_of(Peer(None, connection_pid=os.getpid())) == set()

    asyncio.run(main())


def test_idle_sweep(key: str) -> None:
    async def main() -> None:
        registry = RegionRegistry()
        owners = RegionOwners([registry], OwnerOptions(idle_timeout=0.1))
        owners.start()
        registry.register("r", key, 0, 64, LOCAL)
        deadline = time.monotonic() + 5
        while registry.status():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        assert owners.reclaimed["idle"] == 1
        await owners.stop()

    asyncio.run(main())
