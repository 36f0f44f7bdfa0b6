"""Why a step of dlserve's Python costs several times more inside a request than in a
loop: how much slower a ~5-10 us step runs right after its process waited, by how it
waited.

The step is dlserve's own code (decoding four TensorRefs, wrapping each in a pb_utils
Tensor). Between two runs of it the process waits ``--gap-us`` in one of these ways:

- ``none``: it does not wait (the loop cost);
- ``recv+yield``: ``recv(MSG_DONTWAIT)`` and ``sched_yield`` in turn, as a worker polls
  with ``--busy-poll-us``; ``recv``: the same without the yield;
- ``pyspin``: a pure-Python loop over a byte of shared memory (no system calls);
- ``sleep``: ``time.sleep`` (the process sleeps and is woken);
- ``other``: a loop running some other Python code;
- ``replay``: a loop running the step itself (on the same data, results dropped).

    python tools/cold_step.py [--gap-us 800] [--rounds 1500]
        [--spinners N [--spin recv|python]]

``--spinners``: that many other processes spin meanwhile (as the other workers of a
pipeline do). Prints the median time of the step after each kind of wait.

What it shows (docs/benchmarks.md, BLS section): on the 2-vCPU VM and on the
H200 host alike, any wait, with or without system calls, makes the step ~2x slower, and
only replaying that very step while waiting keeps it at its loop cost. The predictors
and the instruction cache hold what ran last; a step is fast only if it ran last. A
probe for developers, not a benchmark of record (Linux only).
"""

from __future__ import annotations

import argparse
import mmap
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from multiprocessing import Process
from pathlib import Path

import msgspec
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from dlserve.ipc import messages as m
from dlserve.pb_utils.tensor import Tensor


def spinner(kind: str) -> None:
    ours, _theirs = socket.socketpair()
    ours.setblocking(False)
    while True:
        if kind == "python":
            continue
        try:
            ours.recv(64)
        except BlockingIOError:
            pass
        os.sched_yield()


def make_step() -> Callable[[], int]:
    """dlserve's own code: decode a frame's refs, wrap each input in a pb_utils Tensor."""
    ref = m.TensorRef("INPUT_0", "FP32", [1, 3, 224, 224], m.Where.PAYLOAD, 0, 64)
    raw = msgspec.msgpack.encode([ref] * 4)
    decoder = msgspec.msgpack.Decoder(list[m.TensorRef])
    array = np.arange(16, dtype=np.float32)

    def step() -> int:
        tensors = {}
        for got in decoder.decode(raw):
            tensor = Tensor(got.name, array)
            tensors[got.offset] = (tensor.name(), tensor.shape(), got.nbytes)
        return len(tensors)

    return step


def make_waits(step: Callable[[], int], gap_s: float) -> dict[str, Callable[[], None]]:
    ours, _theirs = socket.socketpair()
    ours.setblocking(False)
    flag = mmap.mmap(-1, mmap.PAGESIZE)

    def spin(body: Callable[[], object]) -> Callable[[], None]:
        def wait() -> None:
            end = time.perf_counter() + gap_s
            while time.perf_counter() < end and not flag[0]:
                body()

        return wait

    def poll_recv() -> None:
        try:
            ours.recv(64)
        except BlockingIOError:
            pass

    def poll_recv_yield() -> None:
        poll_recv()
        os.sched_yield()

    def other() -> list[str]:
        table: dict[str, list[object]] = {}
        for i in range(20):
            table[str(i)] = [i, len(table), i * 2.5]
        return sorted(table)

    return {
        "none": lambda: None,
        "recv+yield": spin(poll_recv_yield),
        "recv": spin(poll_recv),
        "pyspin": spin(lambda: None),
        "sleep": lambda: time.sleep(gap_s),
        "other": spin(other),
        "replay": spin(step),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gap-us", type=int, default=800, help="how long each wait lasts")
    parser.add_argument("--rounds", type=int, default=1500)
    parser.add_argument("--spinners", type=int, default=0, help="other processes spinning")
    parser.add_argument("--spin", choices=("recv", "python"), default="recv")
    args = parser.parse_args()
    others = [Process(target=spinner, args=(args.spin,), daemon=True)
              for _ in range(args.spinners)]  # fmt: skip
    for process in others:
        process.start()
    try:
        step = make_step()
        waits = make_waits(step, args.gap_us / 1e6)
        times: dict[str, list[float]] = {name: [] for name in waits}
        for _ in range(200):
            step()
        for _ in range(args.rounds):  # the kinds of wait take turns: the host's drift is shared
            for name, wait in waits.items():
                wait()
                start = time.perf_counter_ns()
                step()
                times[name].append((time.perf_counter_ns() - start) / 1e3)
    finally:
        for process in others:
            process.terminate()
    spinning = f", {args.spinners} {args.spin} spinners" if args.spinners else ""
    print(f"step p50 us after a {args.gap_us}-us wait ({os.cpu_count()} CPUs{spinning}):")
    print("  " + ", ".join(f"{name} {statistics.median(t):.1f}" for name, t in times.items()))


if __name__ == "__main__":
    main()
