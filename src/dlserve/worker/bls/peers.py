"""A worker's mappings of other workers' arenas: BLS tensors passed by reference.

A BLS caller's input (its own input-arena bytes, or a tensor it copied once into its
output arena) reaches the callee as a PEER_ARENA ref; a callee's large output reaches
the caller the same way. Each arena is mapped once, by id, from the path the server
gives (a /proc path of the server's memfd), and dropped when the server says that its
worker is gone.
"""

from __future__ import annotations

import mmap
import os
import threading

from dlserve.ipc import messages as m
from dlserve.pb_utils.exceptions import TritonError
from dlserve.tensors.arena import buffer_address


class PeerArenas:
    """The arenas of other workers this worker has mapped, by arena id."""

    def __init__(self) -> None:
        self._mapped: dict[int, mmap.mmap] = {}
        self._bases: dict[int, tuple[mmap.mmap, int, str]] = {}  # id -> (map, address, path)
        self._lock = threading.Lock()  # model threads read BLS replies too

    def view(self, ref: m.TensorRef) -> memoryview:
        """A writable view of ``ref``'s bytes in another worker's arena."""
        with self._lock:
            mapped = self._mapped.get(ref.region)
            if mapped is None:
                mapped = self._mapped[ref.region] = _map(ref.key)
                self._bases[ref.region] = (mapped, buffer_address(mapped), ref.key)
        end = ref.offset + ref.nbytes
        if ref.offset < 0 or end > len(mapped):
            raise TritonError(f"tensor '{ref.name}' lies outside the arena it names")
        return memoryview(mapped)[ref.offset : end]

    def locate(self, address: int, nbytes: int) -> m.TensorRef | None:
        """A PEER_ARENA ref when these bytes lie in an arena mapped here (a callee's output
        passed on to another model travels by reference again)."""
        if not self._bases:  # none mapped yet: nothing to look through, no lock to take
            return None
        with self._lock:
            for arena, (mapped, start, path) in self._bases.items():
                if start <= address and address + nbytes <= start + len(mapped):
                    offset = address - start
                    return m.TensorRef("", "", [], m.Where.PEER_ARENA, offset, nbytes, arena, path)
        return None

    def drop(self, arenas: list[int]) -> None:
        with self._lock:
            for arena in arenas:
                mapped = self._mapped.pop(arena, None)
                self._bases.pop(arena, None)
                if mapped is not None:
                    _close(mapped)

    def close(self) -> None:
        self.drop(list(self._mapped))


def _map(path: str) -> mmap.mmap:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise TritonError(f"unable to map another model's memory ({path}): {exc}") from None
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def _close(mapped: mmap.mmap) -> None:
    try:
        mapped.close()
    except BufferError:
        pass  # a view outlives the mapping's use: it goes with the last view
