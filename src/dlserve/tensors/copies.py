"""Copies of large buffers that let other threads run meanwhile.

``bytes(view)`` holds the GIL for the whole copy; numpy's copy releases it. The server
makes a copy of more than ``COPY_ON_LOOP_LIMIT`` bytes with :func:`unlocked_copy` on a
thread, so that copying hundreds of megabytes does not hold its event loop, and every
other client with it.
"""

from __future__ import annotations

from typing import Final

import numpy as np

# Above this a copy leaves the event loop for a thread (4 MiB take about 2 ms on the loop;
# a thread's round trip about 0.1 ms).
COPY_ON_LOOP_LIMIT: Final = 4 * 1024 * 1024


def unlocked_copy(data: bytes | bytearray | memoryview, readonly: bool = False) -> memoryview:
    """A copy of ``data``'s bytes, made without holding the GIL; ``readonly``: as bytes
    are, so that nobody changes it."""
    copy = np.frombuffer(memoryview(data).cast("B"), np.uint8).copy()
    if readonly:
        copy.flags.writeable = False
    return copy.data
