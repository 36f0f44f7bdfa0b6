"""Pools of registered shared-memory regions, reused across calls.

A call takes a region big enough for its inputs, uses it alone (so two threads never write
into one region), and gives it back. A region is registered with the server once, when it
is made, and unregistered when the pool drops it (more than ``max_free`` idle) or closes.
Names hold the process id and a random tag: unique across processes, clients and threads.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

MIN_REGION: Final = 1 << 20  # 1 MiB
POWER_OF_TWO_UP_TO: Final = 64 << 20  # bigger requests round up to 2 MiB multiples
ALIGN: Final = 256  # where each tensor starts in a region (CUDA's allocation alignment)
KEY_PREFIX: Final = "dlsc_"  # /dev/shm/dlsc_<pid namespace>_<pid>_<tag>_<kind>_<n>


def pid_namespace() -> str:
    """This process's PID namespace (its inode), "0" where it cannot be read: a pid means
    something only within its namespace, and containers may share /dev/shm but not pids."""
    try:
        link = os.readlink("/proc/self/ns/pid")  # "pid:[4026531836]"
    except OSError:
        return "0"
    inode = link.partition("[")[2].rstrip("]")
    return inode if inode.isdigit() else "0"


@dataclass(slots=True, eq=False)
class Slot:
    name: str  # as registered with the server
    size: int
    device: int  # -1: system shared memory
    region: Any  # shared_memory.SharedMemoryRegion or cuda_shared_memory.CudaSharedMemoryRegion
    registered: bool = False


def region_size(nbytes: int) -> int:
    if nbytes <= MIN_REGION:
        return MIN_REGION
    if nbytes <= POWER_OF_TWO_UP_TO:
        return 1 << (nbytes - 1).bit_length()
    step = 2 << 20
    return -(-nbytes // step) * step


def aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


class RegionPool:
    """The regions of one kind (system memory, or one GPU) of one client."""

    def __init__(
        self, device: int, create: Callable[[str, int], Any], destroy: Callable[[Any], None],
        max_free: int = 8,
    ) -> None:  # fmt: skip
        self.device = device
        self._create = create
        self._destroy = destroy
        self._max_free = max_free
        self._tag = f"{pid_namespace()}_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        self._count = 0
        self._free: list[Slot] = []
        self._all: set[Slot] = set()
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> Slot:
        """The smallest idle region with room for ``nbytes``, or a new one (not registered:
        the caller registers it and sets ``registered``)."""
        with self._lock:
            fitting = [slot for slot in self._free if slot.size >= nbytes]
            if fitting:
                slot = min(fitting, key=lambda s: s.size)
                self._free.remove(slot)
                return slot
            self._count += 1
            where = "host" if self.device < 0 else f"gpu{self.device}"
            name = f"{KEY_PREFIX}{self._tag}_{where}_{self._count}"
        size = region_size(nbytes)
        slot = Slot(name, size, self.device, self._create(name, size))
        with self._lock:
            self._all.add(slot)
        return slot

    def give(self, slot: Slot) -> list[Slot]:
        """``slot`` is idle again; the regions to drop (unregister, then :meth:`destroy`)."""
        with self._lock:
            if slot not in self._all:
                return []
            if not slot.registered:
                self._all.discard(slot)
                return [slot]
            self._free.append(slot)
            if len(self._free) <= self._max_free:
                return []
            smallest = min(self._free, key=lambda s: s.size)
            self._free.remove(smallest)
            self._all.discard(smallest)
            return [smallest]

    def drain(self) -> list[Slot]:
        """Every region, idle or not: the pool is closing."""
        with self._lock:
            slots = list(self._all)
            self._all.clear()
            self._free.clear()
            return slots

    def destroy(self, slot: Slot) -> None:
        self._destroy(slot.region)

    def __len__(self) -> int:
        return len(self._all)
