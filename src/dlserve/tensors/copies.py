"""Copies of large buffers that let other threads run meanwhile.

``bytes(view)`` holds the GIL for the whole copy; numpy's copy releases it. The server
makes a copy of more than ``COPY_ON_LOOP_LIMIT`` bytes with :func:`unlocked_copy` on a
thread, so that copying hundreds of megabytes does not hold its event loop, and every
other client with it.
"""

from __future__ import annotations

from typing import Final

import numpy as np

from dlserve.tensors import mappings

# Above this a copy leaves the event loop for a thread (4 MiB take about 2 ms on the loop;
# a thread's round trip about 0.1 ms).
COPY_ON_LOOP_LIMIT: Final = 4 * 1024 * 1024


def unlocked_copy(data: bytes | bytearray | memoryview, readonly: bool = False) -> memoryview:
    """A copy of ``data``'s bytes, made without holding the GIL; ``readonly``: as bytes
    are, so that nobody changes it. A copy of ``UNMAP_ON_THREAD`` bytes or more has pages
    of its own that a thread gives back (``mappings.py``): wherever its last view goes,
    the event loop does not wait for that."""
    source = np.frombuffer(memoryview(data).cast("B"), np.uint8)
    if source.nbytes < mappings.UNMAP_ON_THREAD:
        copy = source.copy()
        if readonly:
            copy.flags.writeable = False
        return copy.data
    pages = mappings.mapped(source.nbytes)
    np.copyto(np.frombuffer(pages, np.uint8), source)
    return pages.toreadonly() if readonly else pages
