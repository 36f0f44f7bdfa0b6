"""server/core/host/idle_trim.py on a real event loop, with this process's real heap: freed
memory in the middle of the heap stays resident until the process has been idle for a
period, then goes back to the kernel, once per idle stretch; while the process works it
is kept. (A real server giving back what large requests left:
tests/e2e/test_idle_server_memory.py.)"""

from __future__ import annotations

import asyncio
import os
import platform
import sys
import threading
import time

import pytest

from dlserve.server.core.host.idle_trim import IdleTrim

pytestmark = pytest.mark.skipif(
    not (sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"),
    reason="glibc's malloc_trim",
)
MIB = 2**20
PERIOD_S = 0.1


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _free_in_the_middle(mib: int) -> bytes:
    """``mib`` MiB of 1-KiB objects (glibc's heap, not Python's small-object arenas),
    written, then freed below one that stays: the heap's top cannot shrink past it."""
    blocks = [bytes(1024) for _ in range(mib * 1024)]
    pin = bytes(1024)
    del blocks
    return pin


def _spin(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(1000))


def test_freed_heap_goes_back_once_the_process_is_idle() -> None:
    async def main() -> tuple[int, int, int]:
        pin = _free_in_the_middle(128)
        kept = _rss()
        trim = IdleTrim(PERIOD_S)
        trim.start()
        try:
            await asyncio.wait_for(trim.trimmed.wait(), 10)
        finally:
            await trim.stop()
        after = _rss()
        del pin
        return kept, after, trim.trims

    kept, after, trims = asyncio.run(main())
    assert trims == 1
    assert kept - after >= 64 * MIB, (kept / MIB, after / MIB)


def test_nothing_is_given_back_while_the_process_works() -> None:
    async def main() -> tuple[float, float, int]:
        stop = threading.Event()
        worker = threading.Thread(target=_spin, args=(stop,))
        worker.start()
        trim = IdleTrim(PERIOD_S)
        trim.start()
        try:
            await asyncio.sleep(8 * PERIOD_S)  # the work: eight periods long
            stopped = time.monotonic()
            stop.set()
            await asyncio.to_thread(worker.join)
            await asyncio.wait_for(trim.trimmed.wait(), 10)
            return stopped, time.monotonic(), trim.trims
        finally:
            stop.set()
            await trim.stop()

    stopped, trimmed, trims = asyncio.run(main())
    assert trims == 1
    assert trimmed >= stopped + PERIOD_S  # after a whole idle period, not during the work


def test_once_per_idle_stretch_and_again_after_work() -> None:
    async def main() -> list[int]:
        trim = IdleTrim(PERIOD_S)
        trim.start()
        seen = []
        try:
            await asyncio.wait_for(trim.trimmed.wait(), 10)
            await asyncio.sleep(8 * PERIOD_S)  # eight more idle periods: no other trim
            seen.append(trim.trims)
            stop = threading.Event()
            worker = threading.Thread(target=_spin, args=(stop,))
            worker.start()
            await asyncio.sleep(3 * PERIOD_S)  # work, then idle again
            stop.set()
            await asyncio.to_thread(worker.join)
            await asyncio.wait_for(trim.trimmed.wait(), 10)
            seen.append(trim.trims)
        finally:
            await trim.stop()
        return seen

    assert asyncio.run(main()) == [1, 2]


def test_a_period_of_zero_turns_it_off() -> None:
    async def main() -> bool:
        trim = IdleTrim(0)
        trim.start()
        running = trim._task is not None
        await trim.stop()
        return running

    assert asyncio.run(main()) is False
