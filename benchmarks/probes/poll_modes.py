"""Small-request latency with and without busy polling (``--busy-poll-us``).

Starts `dlserve serve` on examples/models (add_sub only) once per mode and round, with
the mode's flags, and times unmodified tritonclient gRPC calls (one client, back to back);
prints p50 / p99 and the CPU the server and its workers spent per request. Modes run
interleaved, so that a noisy machine shifts them alike. On a machine with many cores,
`taskset -c 0,1 python benchmarks/probes/poll_modes.py` shows what a 2-core one sees.

    python benchmarks/probes/poll_modes.py [--requests N] [--rounds R] [--mode NAME=FLAGS ...]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import tritonclient.grpc as grpcclient

ROOT = Path(__file__).resolve().parents[2]
MODES = {
    "no polling (default)": [],
    "busy-poll 200": ["--busy-poll-us", "200"],
    "busy-poll 2000": ["--busy-poll-us", "2000"],
}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _serve(flags: list[str]) -> tuple[subprocess.Popen[bytes], int]:
    port = _free_port()
    command = [sys.executable, "-m", "dlserve", "serve", "--model-repository",
               str(ROOT / "examples" / "models"), "--model-control-mode", "explicit",
               "--load-model", "add_sub", "--grpc-port", str(port), "--http-port", "0",
               "--metrics-port", "0", *flags]  # fmt: skip
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    deadline = time.monotonic() + 120
    while True:
        try:
            if client.is_model_ready("add_sub"):
                return server, port
        except Exception:
            pass
        if time.monotonic() > deadline or server.poll() is not None:
            raise SystemExit(f"dlserve did not start with {flags}")
        time.sleep(0.1)


def _measure(port: int, server: subprocess.Popen[bytes], requests: int) -> str:
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    data = np.ones(16, np.float32)

    def one() -> None:
        inputs = [grpcclient.InferInput(n, [16], "FP32") for n in ("INPUT0", "INPUT1")]
        for tensor in inputs:
            tensor.set_data_from_numpy(data)
        client.infer("add_sub", inputs)

    for _ in range(300):
        one()
    root = psutil.Process(server.pid)
    processes = [root, *root.children(recursive=True)]
    before = [sum(p.cpu_times()[:2]) for p in processes]
    latencies = []
    for _ in range(requests):
        start = time.perf_counter()
        one()
        latencies.append(time.perf_counter() - start)
    after = [sum(p.cpu_times()[:2]) for p in processes]
    latencies.sort()
    server_cpu = (after[0] - before[0]) / requests * 1e6
    worker_cpu = sum(a - b for a, b in zip(after[1:], before[1:], strict=True)) / requests * 1e6
    return (f"p50 {latencies[len(latencies) // 2] * 1e6:6.0f}  "
            f"p99 {latencies[int(len(latencies) * 0.99)] * 1e6:6.0f}  "
            f"cpu/request: server {server_cpu:4.0f} us, workers {worker_cpu:4.0f} us")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--mode", action="append", default=[], metavar="NAME=FLAGS")
    args = parser.parse_args()
    modes = dict(MODES) if not args.mode else {
        name: flags.split() for name, _, flags in (m.partition("=") for m in args.mode)
    }  # fmt: skip
    print(f"{args.requests} add_sub requests per run, cpus {sorted(os.sched_getaffinity(0))}")
    for round_ in range(args.rounds):
        for name, flags in modes.items():
            server, port = _serve(flags)
            try:
                print(f"round {round_}  {name:26s} {_measure(port, server, args.requests)}",
                      flush=True)  # fmt: skip
            finally:
                server.terminate()
                server.wait()


if __name__ == "__main__":
    main()
