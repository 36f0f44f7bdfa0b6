"""A decoupled model's stream: the server's memory under a client that does not read, and
the time per response under one that does.

dlserve serves ``tests/models/flood`` (COUNT responses of SIZE bytes, sent from a thread as
fast as ``send()`` returns). Two measurements, unmodified tritonclient.grpc:

- memory: COUNT x 1 MiB to a stream client whose callback blocks (it reads nothing) for
  ``--hold`` seconds; the server's RSS before and its peak meanwhile (/proc). Then the
  client reads everything, and each response is checked (index, bytes).
- fast path: COUNT x 16 B to a client that reads as they come, 3 runs after a warm-up:
  seconds and microseconds per response.

    python benchmarks/bench_stream.py [--count 300] [--small 5000] [--hold 10]

A benchmark, not a test (tests/e2e/test_flow_control.py is the test).
"""

from __future__ import annotations

import argparse
import queue
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _triton  # a sibling module, not a package

FLOOD = Path(__file__).resolve().parent.parent / "tests" / "models" / "flood"
MIB = 1024 * 1024


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def inputs(count: int, size: int) -> list[grpcclient.InferInput]:
    tensors = []
    for name, value in (("COUNT", count), ("SIZE", size)):
        tensor = grpcclient.InferInput(name, [1], "INT32")
        tensor.set_data_from_numpy(np.array([value], dtype=np.int32))
        tensors.append(tensor)
    return tensors


def memory(server: _triton.RunningServer, count: int, hold_s: float) -> None:
    gate = threading.Event()
    got: queue.Queue[tuple[Any, Any]] = queue.Queue()

    def callback(result: Any, error: Any) -> None:
        gate.wait()
        got.put((result, error))

    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.start_stream(callback=callback)
        before = peak = rss_mib(server.process.pid)
        client.async_stream_infer("flood", inputs(count, MIB), request_id="memory")
        until = time.monotonic() + hold_s
        while time.monotonic() < until:
            peak = max(peak, rss_mib(server.process.pid))
            time.sleep(0.1)
        gate.set()
        for index in range(count):
            result, error = got.get(timeout=300)
            assert error is None and int(result.as_numpy("INDEX")[0]) == index
            assert np.all(result.as_numpy("OUTPUT0") == index % 256)
        client.stop_stream()
    print(f"memory: {count} x 1 MiB to a client that reads nothing for {hold_s:g} s: server "
          f"RSS {before:.0f} MiB -> peak {peak:.0f} MiB (+{peak - before:.0f}); then all "
          f"{count} received intact, in order")  # fmt: skip


def fast_path(server: _triton.RunningServer, count: int) -> None:
    got: queue.Queue[Any] = queue.Queue()
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.start_stream(callback=lambda result, error: got.put(error))
        for run in range(4):
            started = time.perf_counter()
            client.async_stream_infer("flood", inputs(count, 16), request_id=f"fast{run}")
            for _ in range(count):
                assert got.get(timeout=300) is None
            took = time.perf_counter() - started
            if run:  # the first is a warm-up
                print(f"fast path: {count} x 16 B read as they come: {took:.2f} s, "
                      f"{took / count * 1e6:.0f} us per response")  # fmt: skip
        client.stop_stream()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=300, help="1 MiB responses (memory)")
    parser.add_argument("--small", type=int, default=5000, help="16 B responses (fast path)")
    parser.add_argument("--hold", type=float, default=10.0, help="seconds the client reads nothing")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        shutil.copytree(FLOOD, Path(root) / "flood")
        ports = _triton.free_ports(3)
        with _triton.run_dlserve(Path(root), *ports) as server:
            memory(server, args.count, args.hold)
            fast_path(server, args.small)


if __name__ == "__main__":
    main()
