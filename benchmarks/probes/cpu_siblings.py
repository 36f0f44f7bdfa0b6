"""Does a process spinning on one CPU slow Python code on another? On the device hosts
(Firecracker VMs) some vCPUs share a physical core, which the guest cannot see (lscpu
says one thread per core); a busy-polling process there halves its neighbour's speed.

Times a fixed pure-Python loop pinned to CPU 0, alone and with a process spinning in
``poll(0)`` on each other CPU in turn, then on several at once, then alone again (the
host's own drift):

    python benchmarks/probes/cpu_siblings.py

A probe for developers, not a benchmark of record (Linux only).
"""

from __future__ import annotations

import os
import select
import socket
import statistics
import time
from multiprocessing import Process

SPIN_S = 1.2
LOOPS = 3000


def spin(cpu: int, seconds: float) -> None:
    os.sched_setaffinity(0, {cpu})
    ours, _theirs = socket.socketpair()
    poller = select.poll()
    poller.register(ours, select.POLLIN)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        poller.poll(0)


def loop_us() -> float:
    """The median time of a fixed piece of pure-Python work (microseconds)."""
    times = []
    for _ in range(LOOPS):
        start = time.perf_counter()
        total = 0
        for i in range(300):
            total += i * i
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def with_spinners(cpus: list[int]) -> float:
    spinners = [Process(target=spin, args=(cpu, SPIN_S)) for cpu in cpus]
    for process in spinners:
        process.start()
    time.sleep(0.2)  # a benchmark's settling time, not a wait for an event
    took = loop_us()
    for process in spinners:
        process.join()
    return took


def main() -> None:
    os.sched_setaffinity(0, {0})
    count = os.cpu_count() or 1
    print(f"alone: {with_spinners([]):.1f} us")
    for cpu in range(1, count):
        print(f"a spinner on CPU {cpu}: {with_spinners([cpu]):.1f} us")
    for spinners in sorted({2, 4, 8, count - 1} & set(range(2, count))):
        took = with_spinners(list(range(1, spinners + 1)))
        print(f"spinners on CPUs 1-{spinners}: {took:.1f} us")
    print(f"alone: {with_spinners([]):.1f} us")


if __name__ == "__main__":
    main()
