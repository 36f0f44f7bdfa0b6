"""Does a process spinning on one CPU slow Python code on another? On the device hosts
(Firecracker VMs) it does: lscpu says one thread per core, yet a process busy on another
vCPU halves the speed of pure-Python code on CPU 0 for many choices of that vCPU, and
which ones changes from run to run (docs/benchmarks.md, the machines).
The vCPUs share the host's cores with each other and with other tenants, so every
running vCPU counts, whatever it runs: a loop of ``poll(0)`` system calls and a loop of
pure Python (``--spin python``) slowed it alike.

Times a fixed pure-Python loop pinned to CPU 0, alone and with a process spinning on each
other CPU in turn, then on several at once, then alone again (the host's own drift):

    python tools/cpu_siblings.py [--spin poll|python]

A probe for developers, not a benchmark of record (Linux only).
"""

from __future__ import annotations

import argparse
import os
import select
import socket
import statistics
import time
from multiprocessing import Process

SPIN_S = 1.2
LOOPS = 3000


def spin(cpu: int, seconds: float, kind: str) -> None:
    os.sched_setaffinity(0, {cpu})
    end = time.perf_counter() + seconds
    if kind == "python":  # no system calls at all
        while time.perf_counter() < end:
            pass
        return
    ours, _theirs = socket.socketpair()
    poller = select.poll()
    poller.register(ours, select.POLLIN)
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


def with_spinners(cpus: list[int], kind: str = "poll") -> float:
    spinners = [Process(target=spin, args=(cpu, SPIN_S, kind)) for cpu in cpus]
    for process in spinners:
        process.start()
    time.sleep(0.2)  # a benchmark's settling time, not a wait for an event
    took = loop_us()
    for process in spinners:
        process.join()
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spin", choices=("poll", "python"), default="poll",
                        help="poll(0) system calls, or pure Python")  # fmt: skip
    kind = parser.parse_args().spin
    os.sched_setaffinity(0, {0})
    count = os.cpu_count() or 1
    print(f"alone: {with_spinners([]):.1f} us")
    for cpu in range(1, count):
        print(f"a spinner on CPU {cpu}: {with_spinners([cpu], kind):.1f} us")
    for spinners in sorted({2, 4, 8, count - 1} & set(range(2, count))):
        took = with_spinners(list(range(1, spinners + 1)), kind)
        print(f"spinners on CPUs 1-{spinners}: {took:.1f} us")
    print(f"alone: {with_spinners([]):.1f} us")


if __name__ == "__main__":
    main()
