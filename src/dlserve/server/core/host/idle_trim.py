"""The server's freed heap back to the kernel once it is idle.

Under load the server keeps freed heap (``tensors/heap.py`` keeps up to 128 MiB of it) so
that large requests reuse pages that are already resident; glibc gives back only the
heap's top, so once the load stops what the server holds at rest depends on where its
heap was left, tens of megabytes either way from one run to the next. :class:`IdleTrim`
looks every ``idle_s`` seconds at the CPU time the process used since it last looked: a
period in which it used almost none (under 1% of one core) follows a period of work, the
server is idle, and the heap's free pages are given back (:func:`heap.give_back`), once
per idle stretch. An idle server uses no CPU at all between its health checks; one under
load uses a core, so the two are far apart. The next large request after a trim pays for
fresh pages once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Final

from dlserve.tensors import heap

IDLE_S: Final = 5.0
IDLE_CPU_FRACTION: Final = 0.01  # of one core, over a period: below it the server is idle


class IdleTrim:
    """Looks every ``idle_s`` seconds; gives the heap back after the first idle period
    that follows work (and once at the first idle period after it starts)."""

    def __init__(self, idle_s: float = IDLE_S) -> None:
        self.idle_s = idle_s
        self.trims = 0  # how many times the heap was given back
        self.trimmed = asyncio.Event()  # set at each trim (for whoever waits for one)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.idle_s > 0 and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="idle-trim")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        worked = True  # what loading the models left is given back at the first idle period
        last = time.process_time()
        while True:
            await asyncio.sleep(self.idle_s)
            now = time.process_time()
            busy = now - last > self.idle_s * IDLE_CPU_FRACTION
            last = now
            if busy:
                worked = True
            elif worked:
                worked = False
                await asyncio.to_thread(heap.give_back)
                self.trims += 1
                self.trimmed.set()
                self.trimmed = asyncio.Event()
                last = time.process_time()  # the trim's own CPU is not work
