"""Regions belong to the local client processes that registered them; when one exits, the
regions it left are unregistered, so the memory behind them is really freed.

1. At registration, the owner is found (``procfs``): the process holding the client end of
   the loopback TCP connection, or the peer (SO_PEERCRED) of a Unix-socket connection.
2. Each owner is watched: a pidfd (``pidfd_open``) becomes readable when the process exits,
   and the event loop's ``add_reader`` calls back at once. Where pidfd is missing, owners
   are polled every ``POLL_S`` seconds.
3. On exit, its regions are unregistered exactly as an explicit unregister would (a region
   in use goes when its last request ends), and every worker unmaps them; a log line and the
   ``dlserve_shm_regions_reclaimed_total`` counter say so.

``--shm-idle-timeout`` adds a sweep that unregisters regions no request has used for that
long. A remote or unseen peer's regions have no owner: only an unregister call or the idle
timeout removes them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Final, Protocol

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from dlserve.server.core.host import procfs
from dlserve.server.core.shm.registry import is_local
from dlserve.types import Peer

log = logging.getLogger("dlserve.shm")

POLL_S: Final = 0.5
RECLAIMED: Final = "dlserve_shm_regions_reclaimed_total"


class Reclaimable(Protocol):
    """A registry of regions that can be reclaimed (system and CUDA shared memory)."""

    def reclaim(self, pid: int) -> list[str]: ...

    def drop_idle(self, unused_since: float) -> list[str]: ...


@dataclass(slots=True)
class OwnerOptions:
    idle_timeout: float | None = None  # seconds; None: regions never idle out


class RegionOwners:
    """Finds the owners of new regions, watches them, reclaims what they leave."""

    def __init__(self, registries: Iterable[Reclaimable], options: OwnerOptions) -> None:
        self.registries = list(registries)
        self.options = options
        self.reclaimed: dict[str, int] = {"owner_exit": 0, "idle": 0}
        self._pidfds: dict[int, int] = {}
        self._polled: set[int] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self.options.idle_timeout is not None:
            self._tasks.append(asyncio.create_task(self._sweep(self.options.idle_timeout)))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        for pid in list(self._pidfds):
            self._unwatch(pid)
        self._polled.clear()

    # -- owners -------------------------------------------------------------------------
    async def owners_of(self, peer: Peer | None) -> set[int]:
        """The local processes a register call from ``peer`` came from (empty: unknown)."""
        if peer is None:
            return set()
        if peer.address is None:  # a Unix socket: its connection said who it is
            pid = peer.connection_pid
            return {pid} if pid is not None and pid != os.getpid() else set()
        if peer.port is not None and is_local(peer):
            candidates = await asyncio.to_thread(procfs.tcp_peer_processes, peer.address, peer.port)
        else:
            return set()
        candidates.discard(os.getpid())
        if peer.pid is not None and peer.pid in candidates:
            return {peer.pid}
        return candidates

    def watch(self, pids: Iterable[int]) -> None:
        """Reclaim the regions of each of ``pids`` when it exits."""
        for pid in pids:
            if pid in self._pidfds or pid in self._polled:
                continue
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                self._call_soon(pid)  # gone already
                continue
            except (OSError, AttributeError):
                self._poll(pid)
                continue
            self._pidfds[pid] = fd
            assert self._loop is not None, "start() first"
            self._loop.add_reader(fd, self._exited, pid)

    def _call_soon(self, pid: int) -> None:
        assert self._loop is not None, "start() first"
        self._loop.call_soon(self._exited, pid)

    def _poll(self, pid: int) -> None:
        self._polled.add(pid)
        if len(self._polled) == 1:
            self._tasks.append(asyncio.create_task(self._poll_loop()))

    async def _poll_loop(self) -> None:
        while self._polled:
            await asyncio.sleep(POLL_S)  # a timer: there is no exit event to wait on
            for pid in [p for p in self._polled if not _alive(p)]:
                self._polled.discard(pid)
                self._exited(pid)

    def _unwatch(self, pid: int) -> None:
        fd = self._pidfds.pop(pid, None)
        if fd is not None:
            if self._loop is not None:
                self._loop.remove_reader(fd)
            os.close(fd)

    def _exited(self, pid: int) -> None:
        self._unwatch(pid)
        names = [name for registry in self.registries for name in registry.reclaim(pid)]
        if names:
            self.reclaimed["owner_exit"] += len(names)
            log.info(
                "client process %d exited: reclaimed its shared memory regions %s",
                pid, ", ".join(repr(n) for n in names),
            )  # fmt: skip

    # -- idle regions -------------------------------------------------------------------
    async def _sweep(self, timeout: float) -> None:
        while True:
            await asyncio.sleep(min(max(timeout / 4, 0.05), 1.0))  # a periodic timer
            since = time.monotonic() - timeout
            names = [name for registry in self.registries for name in registry.drop_idle(since)]
            if names:
                self.reclaimed["idle"] += len(names)
                log.info(
                    "unregistered shared memory regions unused for %g s: %s",
                    timeout, ", ".join(repr(n) for n in names),
                )  # fmt: skip


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except OSError:
        return False


class ReclaimCollector(Collector):
    """``dlserve_shm_regions_reclaimed_total{reason="owner_exit"|"idle"}``."""

    def __init__(self, owners: RegionOwners) -> None:
        self._owners = owners

    def collect(self) -> Iterator[Metric]:
        metric = Metric(
            RECLAIMED,
            "Number of client shared memory regions unregistered by the server: their "
            "owner process exited, or they were unused for --shm-idle-timeout",
            "counter",
        )
        metric.name = RECLAIMED  # prometheus_client drops "_total" from a counter's name
        for reason, count in self._owners.reclaimed.items():
            metric.add_sample(RECLAIMED, {"reason": reason}, count)
        yield metric
