"""POSIX shared memory segments and the arenas carved out of them.

Segments are files in /dev/shm opened with ``os.open`` and mapped with
``mmap``; unlike ``multiprocessing.shared_memory`` nothing registers them with
a resource tracker, so the creator alone decides when a name goes away.
"""

from __future__ import annotations

import bisect
import mmap
import os
import stat
import threading
from typing import Final

import numpy as np

SHM_DIR: Final = "/dev/shm"
ALIGN: Final = 64


class ShmSegment:
    """A mapped shared-memory object: a named POSIX one, or an anonymous memfd.

    Anonymous segments have no name anywhere, so nothing can be left behind;
    they are shared by handing the file descriptor to the other process.
    """

    def __init__(self, name: str, size: int, *, create: bool) -> None:
        path = os.path.join(SHM_DIR, name.lstrip("/"))
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            self._setup(name, fd, size if create else None)
        finally:
            os.close(fd)
        self.fd: int | None = None

    @classmethod
    def anonymous(cls, name: str, size: int) -> ShmSegment:
        """A memfd of ``size`` bytes; ``fd`` stays open until ``close_fd``."""
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        segment = cls.__new__(cls)
        try:
            segment._setup(name, fd, size)
        except BaseException:
            os.close(fd)
            raise
        segment.fd = fd
        return segment

    @classmethod
    def from_fd(cls, fd: int, name: str) -> ShmSegment:
        """Map a segment received as a file descriptor (which is closed)."""
        segment = cls.__new__(cls)
        try:
            segment._setup(name, fd, None)
        finally:
            os.close(fd)
        segment.fd = None
        return segment

    def _setup(self, name: str, fd: int, size: int | None) -> None:
        if size is not None:
            os.ftruncate(fd, size)
        else:
            size = os.fstat(fd).st_size
        self.name = name
        self.size = size
        self._mmap = mmap.mmap(fd, size) if size > 0 else None

    def close_fd(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    @property
    def buffer(self) -> memoryview:
        if self._mmap is None:
            return memoryview(b"")
        return memoryview(self._mmap)

    def close(self) -> None:
        """Unmap; while views are exported the mapping stays until they are gone."""
        self.close_fd()
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                return
            self._mmap = None

    def unlink(self) -> None:
        unlink_name(self.name)


def unlink_name(name: str) -> None:
    try:
        os.unlink(os.path.join(SHM_DIR, name.lstrip("/")))
    except FileNotFoundError:
        pass


def open_client_object(key: str) -> int:
    """A read-write descriptor of a client's POSIX shared-memory object (``shm_open``'s
    name: leading slashes optional, no other slash), close-on-exec.

    A symbolic link is not followed and anything but a regular file is refused, so a
    key cannot make the opener map some other file. Raises OSError, or ValueError for a
    name that shm_open would refuse.
    """
    name = key.lstrip("/")
    if not name or "/" in name or name in (".", "..") or "\0" in name:
        raise ValueError(f"'{key}' is not a shared-memory object name")
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(os.path.join(SHM_DIR, name), flags)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"'{key}' is not a shared-memory object")
    except BaseException:
        os.close(fd)
        raise
    return fd


def object_size(fd: int) -> int:
    """The current size of an open shared-memory object (a client may change it)."""
    return os.fstat(fd).st_size


class Arena:
    """First-fit allocator over one segment: offsets in, offsets out.

    Each arena has one allocating side (the server allocates input space, the worker
    output space) and frees arrive on that side too. A lock makes it safe for the
    threads of a worker (a decoupled model sends responses from its own threads).
    """

    def __init__(self, segment: ShmSegment) -> None:
        self.segment = segment
        self._free_offsets: list[int] = [0]
        self._free_sizes: dict[int, int] = {0: segment.size}
        self._used: dict[int, int] = {}
        self._lock = threading.Lock()

    def alloc(self, nbytes: int) -> int | None:
        with self._lock:
            return self._alloc(nbytes)

    def free(self, offset: int) -> None:
        with self._lock:
            self._free(offset)

    def _alloc(self, nbytes: int) -> int | None:
        size = max(ALIGN, (nbytes + ALIGN - 1) & ~(ALIGN - 1))
        for index, offset in enumerate(self._free_offsets):
            free = self._free_sizes[offset]
            if free >= size:
                del self._free_offsets[index]
                del self._free_sizes[offset]
                if free > size:
                    self._insert_free(offset + size, free - size)
                self._used[offset] = size
                return offset
        return None

    def _free(self, offset: int) -> None:
        size = self._used.pop(offset)
        index = bisect.bisect_left(self._free_offsets, offset)
        # merge with the following block
        if index < len(self._free_offsets) and self._free_offsets[index] == offset + size:
            following = self._free_offsets.pop(index)
            size += self._free_sizes.pop(following)
        # merge with the preceding block
        if index > 0:
            before = self._free_offsets[index - 1]
            if before + self._free_sizes[before] == offset:
                self._free_sizes[before] += size
                return
        self._insert_free(offset, size)

    def _insert_free(self, offset: int, size: int) -> None:
        bisect.insort(self._free_offsets, offset)
        self._free_sizes[offset] = size

    @property
    def used_bytes(self) -> int:
        return sum(self._used.values())

    def view(self, offset: int, nbytes: int) -> memoryview:
        return self.segment.buffer[offset : offset + nbytes]


def buffer_address(buffer: bytes | bytearray | memoryview | mmap.mmap) -> int:
    """The address of a contiguous buffer's first byte (0 when it is empty): an mmap, a
    view of one, a numpy array's data. No export of the buffer outlives the call, so an
    mmap can still be closed afterwards."""
    view = memoryview(buffer)
    if view.nbytes == 0:
        return 0
    return int(np.frombuffer(view, dtype=np.uint8, count=1).ctypes.data)
