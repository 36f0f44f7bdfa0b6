"""Large buffers with pages of their own, given back to the kernel by a thread.

Giving a gigabyte of written pages back to the kernel (``munmap``) takes tens of
milliseconds; when the last view of such a buffer goes on the server's event loop (a 1 GiB
output once its response is sent), every other client waits that long. A buffer from
:func:`mapped` is private anonymous memory mapped here; once nothing views it, a thread
of its own unmaps it, without the GIL.

Linux and other POSIX systems with ``mmap``; buffers are unmapped in the order they are
released.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import queue
import threading
import weakref
from typing import Final

import numpy as np

# Buffers this large are worth a thread's unmapping (glibc maps a buffer of 32 MiB or more
# on its own too, and unmaps it where it is freed).
UNMAP_ON_THREAD: Final = 32 * 2**20

_libc = ctypes.CDLL(None, use_errno=True)
_mmap = _libc.mmap
_mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                  ctypes.c_long)  # fmt: skip
_mmap.restype = ctypes.c_void_p
_munmap = _libc.munmap
_munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_munmap.restype = ctypes.c_int
_MAP_FAILED: Final = ctypes.c_void_p(-1).value

_Work = tuple[int, int] | threading.Event  # (address, size) to unmap, or a marker to set
_unmapping: queue.SimpleQueue[_Work] | None = None
_starting = threading.Lock()


class _Pages:
    """The mapping's memory as numpy sees it (``__array_interface__``): every view of the
    buffer keeps this object, and its finalizer hands the mapping to the thread."""

    __slots__ = ("__array_interface__", "__weakref__")

    def __init__(self, address: int, size: int) -> None:
        self.__array_interface__ = {
            "data": (address, False), "shape": (size,), "typestr": "|u1", "version": 3,
        }  # fmt: skip


def mapped(size: int) -> memoryview:
    """``size`` bytes (> 0) of fresh private pages, writable; unmapped by a thread once no
    view of them is left. MemoryError where the kernel has no room."""
    work = _queue()
    address = _mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE,
                    mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)  # fmt: skip
    if address is None or address == _MAP_FAILED:
        raise MemoryError(f"mmap of {size} bytes: {os.strerror(ctypes.get_errno())}")
    pages = _Pages(address, size)
    finalizer = weakref.finalize(pages, work.put, (address, size))
    finalizer.atexit = False  # the process's end unmaps everything
    return np.asarray(pages).data


def unmapped() -> None:
    """Return once every buffer released so far is unmapped."""
    done = threading.Event()
    _queue().put(done)
    done.wait()


def _queue() -> queue.SimpleQueue[_Work]:
    global _unmapping
    with _starting:
        if _unmapping is None:
            _unmapping = queue.SimpleQueue()
            threading.Thread(target=_unmap, args=(_unmapping,), name="dlserve-unmap",
                             daemon=True).start()  # fmt: skip
        return _unmapping


def _unmap(work: queue.SimpleQueue[_Work]) -> None:
    while True:
        item = work.get()
        if isinstance(item, threading.Event):
            item.set()
        else:
            _munmap(*item)  # ctypes lets the GIL go for the call
