"""What restricted endpoint groups cost a small request: an A/B of ``dlserve serve`` servers.

Each variant is a real server (examples/models add_sub) driven by tritonclient, one client,
16-float inputs: p50 of ``--requests`` gRPC ``infer`` calls, then as many HTTP ones.
Variants, run in turn for ``--rounds`` rounds (timings on a shared machine drift, so they
are interleaved) and reported as the median of their rounds' p50s:

- ``before``: ``--against SRC`` (another checkout's ``src``, e.g. ``git archive main src``),
  no option;
- ``none``: this checkout, no option (the frontends' one attribute check);
- ``other``: model-repository restricted on both protocols: inference is not, but HTTP
  looks its route up;
- ``inference``: inference restricted, and the client sends the header.

    python tools/restricted.py --against SRC [--requests N] [--rounds R]

A probe for developers, not a benchmark of record.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "models"
ELEMENTS = 16
WARMUP = 300
ADMIN = ["--grpc-restricted-protocol=model-repository:admin-key=secret",
         "--http-restricted-api=model-repository:admin-key=secret"]  # fmt: skip
INFERENCE = ["--grpc-restricted-protocol=inference:key=secret",
             "--http-restricted-api=inference:key=secret"]  # fmt: skip
HEADERS = {"grpc": {"triton-grpc-protocol-key": "secret"}, "http": {"key": "secret"}}


def _start(src: str, extra: list[str]) -> tuple[subprocess.Popen[bytes], dict[str, int]]:
    read_fd, write_fd = os.pipe()
    command = [sys.executable, "-m", "dlserve", "serve", "--model-repository", str(EXAMPLES),
               "--model-control-mode", "explicit", "--load-model", "add_sub",
               "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0",
               "--ready-fd", str(write_fd), *extra]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": src}
    server = subprocess.Popen(
        command, pass_fds=(write_fd,), env=env, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as ready:
        line = ready.readline()
    if not line:
        raise RuntimeError("dlserve exited during startup")
    return server, json.loads(line)


def _cpu_us(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return (times.user + times.system) * 1e6


def _timed(
    client: Any, module: Any, requests: int, headers: dict[str, str] | None, pid: int
) -> tuple[float, float]:
    """p50 latency and the server process's CPU per request (its workers not counted)."""
    inputs = [module.InferInput(n, [ELEMENTS], "FP32") for n in ("INPUT0", "INPUT1")]
    for tensor in inputs:
        tensor.set_data_from_numpy(np.ones(ELEMENTS, dtype=np.float32))
    for _ in range(WARMUP):
        client.infer("add_sub", inputs, headers=headers)
    samples = []
    clock = time.perf_counter_ns
    cpu = _cpu_us(pid)
    for _ in range(requests):
        start = clock()
        client.infer("add_sub", inputs, headers=headers)
        samples.append(clock() - start)
    cpu = (_cpu_us(pid) - cpu) / requests
    samples.sort()
    return samples[len(samples) // 2] / 1000, cpu


def run(
    src: str, extra: list[str], requests: int, send_headers: bool
) -> dict[str, tuple[float, float]]:
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    server, ports = _start(src, extra)
    try:
        out = {}
        for name, module, port in (("grpc", grpcclient, ports["grpc_port"]),
                                   ("http", httpclient, ports["http_port"])):  # fmt: skip
            client = module.InferenceServerClient(f"127.0.0.1:{port}")
            headers = HEADERS[name] if send_headers else None
            out[name] = _timed(client, module, requests, headers, server.pid)
            client.close()
        return out
    finally:
        server.terminate()
        server.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", required=True, help="the 'before' checkout's src folder")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    here = str(ROOT / "src")
    variants = {
        "before": (args.against, [], False),
        "none": (here, [], False),
        "other": (here, ADMIN, False),
        "inference": (here, INFERENCE, True),
    }
    Rounds = dict[str, list[tuple[float, float]]]
    results: dict[str, Rounds] = {v: {"grpc": [], "http": []} for v in variants}
    for _ in range(args.rounds):
        for variant, (src, extra, send) in variants.items():
            for protocol, timing in run(src, extra, args.requests, send).items():
                results[variant][protocol].append(timing)
    for protocol in ("grpc", "http"):
        base = statistics.median(p50 for p50, _ in results["before"][protocol])
        for variant, by_protocol in results.items():
            rounds = by_protocol[protocol]
            p50 = statistics.median(p for p, _ in rounds)
            cpu = statistics.median(c for _, c in rounds)
            print(f"{protocol} {variant:9s} p50 {p50:7.1f} us {[round(p) for p, _ in rounds]} "
                  f"({p50 / base:.2f}x)  server cpu {cpu:6.1f} us/request "
                  f"{[round(c) for _, c in rounds]}")  # fmt: skip


if __name__ == "__main__":
    main()
