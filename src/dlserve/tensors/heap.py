"""Keep the pages of large buffers between requests (glibc's malloc, Linux).

A request with megabytes of tensor data allocates buffers of that size in the server (the
message as it arrives, an output's bytes for the wire) and in a model (its outputs). With
glibc's defaults such a buffer gets fresh pages from the kernel each time: either it is
mapped on its own (above the mmap threshold) or the heap's top is given back once more
than twice that much is free (the trim threshold) and taken again. Every fresh page
faults on its first write: for 4 MB, 1024 faults, which cost several times the copy
itself (the performance page has the numbers). Buffers up to 32 MB come from the heap, and up to
128 MB of freed heap is kept, so the next request reuses pages that are already there.

The user's own ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` win; nothing
happens where the C library is not glibc. What is kept is given back once the load stops
(:func:`give_back`, called by the server when it has been idle a while:
``server/core/host/idle_trim.py``). For that the server's threads share one heap
(:func:`one_heap`): glibc gives each thread that allocates a heap of its own, and a
thread's heap keeps its free top for as long as the trim threshold allows, trim or not. An
output the server copies off its loop, in an executor thread, and frees on the loop would
stay there.

Workers also copy megabytes with non-temporal stores (:func:`streaming_copies`): a worker
writes an output into a client's region, or its output arena, for another process to read;
keeping those bytes in the worker's caches only evicts what the processes on the request's
path need next. glibc switches to such stores above a threshold it derives from the shared
cache per thread; a VM that reports its host's whole L3 to a few vCPUs gets a threshold of
tens of megabytes, so it never does. The workers get glibc's usual bare-metal value, 1 MiB
(docs/benchmarks.md, Measurements behind design decisions).

The server turns transparent huge pages off for itself (:func:`no_huge_pages`), as Redis
does: a fault on a fresh huge page zeroes 2 MiB at once on the thread that touched it, and
the event loop touches the buffers of messages as they arrive. Where the kernel has to take
the huge page from memory it has not used lately (a VM whose host reclaims the guest's free
memory), one such fault holds the loop for tens of milliseconds; 4 KiB pages cost a little
each. Workers run models and get the setting the server started with.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import platform
import sys
from collections.abc import Mapping
from typing import Any, Final

M_TRIM_THRESHOLD: Final = -1
M_MMAP_THRESHOLD: Final = -3
M_ARENA_MAX: Final = -8
MMAP_THRESHOLD: Final = 32 * 2**20  # glibc's largest on 64-bit
TRIM_THRESHOLD: Final = 128 * 2**20
NON_TEMPORAL_TUNABLE: Final = "glibc.cpu.x86_non_temporal_threshold"
NON_TEMPORAL_THRESHOLD: Final = 2**20
PR_SET_THP_DISABLE: Final = 41
PR_GET_THP_DISABLE: Final = 42

_huge_pages_off = False  # this process turned them off (no_huge_pages)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def _c_function(name: str) -> Any:
    """The C library's function ``name``; None off Linux or where the library has none
    (musl has no mallopt or malloc_trim)."""
    if not sys.platform.startswith("linux"):
        return None
    return getattr(_libc(), name, None)


def _mallopt(*settings: tuple[int, int]) -> bool:
    """glibc's ``mallopt(option, value)`` for each setting; whether all were done."""
    mallopt = _c_function("mallopt")
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return all(mallopt(option, value) for option, value in settings)


def keep_large_buffers() -> bool:
    """Tune this process's malloc as above; whether it was done."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False
    return _mallopt((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def one_heap() -> bool:
    """All of this process's threads allocate from one heap (glibc's ``M_ARENA_MAX`` 1),
    unless the user set ``MALLOC_ARENA_MAX``; whether it was done. Call it before threads
    start."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    return _mallopt((M_ARENA_MAX, 1))


def give_back() -> bool:
    """Return the heap's free pages to the kernel, wherever they are in the heap (glibc's
    ``malloc_trim(0)``, which also releases free pages below the heap's top); whether
    anything was given back. ctypes lets go of the GIL for the call."""
    trim = _c_function("malloc_trim")
    if trim is None:
        return False
    trim.argtypes, trim.restype = (ctypes.c_size_t,), ctypes.c_int
    return bool(trim(0))


def streaming_copies(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (the server's own by default) for a worker, with glibc's non-temporal-store
    threshold set to 1 MiB (``GLIBC_TUNABLES``), unless the user set it (x86-64 Linux)."""
    result = dict(os.environ if env is None else env)
    if not sys.platform.startswith("linux") or platform.machine() != "x86_64":
        return result
    tunables = result.get("GLIBC_TUNABLES", "")
    if NON_TEMPORAL_TUNABLE in tunables:
        return result
    setting = f"{NON_TEMPORAL_TUNABLE}={NON_TEMPORAL_THRESHOLD:#x}"
    result["GLIBC_TUNABLES"] = f"{tunables}:{setting}" if tunables else setting
    return result


def _prctl(option: int, value: int = 0) -> int:
    """``prctl(option, value, 0, 0, 0)``; -1 where it fails or there is no prctl."""
    prctl = _c_function("prctl")
    if prctl is None:
        return -1
    prctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                      ctypes.c_ulong)  # fmt: skip
    prctl.restype = ctypes.c_int
    return int(prctl(option, value, 0, 0, 0))


def no_huge_pages() -> bool:
    """Turn transparent huge pages off for this process (Linux ``PR_SET_THP_DISABLE``),
    where they were on; whether this call turned them off. Processes started from now on
    inherit the setting: see :func:`huge_pages_turned_off`."""
    global _huge_pages_off
    if _prctl(PR_GET_THP_DISABLE) != 0:  # off already (inherited), or no prctl
        return False
    _huge_pages_off = _prctl(PR_SET_THP_DISABLE, 1) == 0
    return _huge_pages_off


def huge_pages_turned_off() -> bool:
    """Whether :func:`no_huge_pages` turned them off here: a process started from this one
    then calls :func:`huge_pages_again` to run with the setting this one started with."""
    return _huge_pages_off


def huge_pages_again() -> bool:
    """Undo the setting inherited from a process that called :func:`no_huge_pages`."""
    return _prctl(PR_SET_THP_DISABLE, 0) == 0
