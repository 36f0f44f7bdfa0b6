"""Continuous batching of an iterative model, dlserve against the real Triton 2.51.

``benchmarks/models_iterative/steps``: a generation loop, one step per ``execute`` (2 ms
of sleep whatever the batch, as a batched GPU step), each request rescheduled
(``set_release_flags(RESCHEDULE)``) until it has had ``--steps`` steps; one instance,
``max_batch_size: 8``, ``sequence_batching { iterative_sequence: true }``. C client
threads (unmodified tritonclient.grpc) send requests back to back for ``--duration``
seconds. Without continuous batching a request would wait for the others to finish;
with it, new requests join the executes of those in flight.

    .venv/bin/python benchmarks/bench_iterative.py [--servers dlserve,triton]
        [--clients 1,8] [--steps 20] [--duration 5]

Prints per server and client count: requests/s, p50 / p99 latency, and the mean batch
(inferences per execute, from the statistics). A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _triton  # a sibling module, not a package

MODELS = Path(__file__).resolve().parent / "models_iterative"
RUNNERS = {"dlserve": _triton.run_dlserve, "triton": _triton.run_triton}
_ids = itertools.count()


def client_loop(url: str, steps: int, until: float, latencies: list[float]) -> None:
    import tritonclient.grpc as grpcclient

    with grpcclient.InferenceServerClient(url) as client:
        tensor = grpcclient.InferInput("STEPS", [1, 1], "INT32")
        tensor.set_data_from_numpy(np.array([[steps]], np.int32))
        while time.monotonic() < until:
            start = time.perf_counter()
            result = client.infer("steps", [tensor], request_id=f"r{next(_ids)}")
            latencies.append(time.perf_counter() - start)
            assert result.as_numpy("DONE").item() == steps


def measure(url: str, clients: int, steps: int, duration: float) -> dict[str, Any]:
    import tritonclient.grpc as grpcclient

    with grpcclient.InferenceServerClient(url) as client:
        before = client.get_inference_statistics("steps").model_stats[0]
    client_loop(url, steps, time.monotonic() + 0.5, [])  # warm-up
    latencies: list[list[float]] = [[] for _ in range(clients)]
    until = time.monotonic() + duration
    threads = [threading.Thread(target=client_loop, args=(url, steps, until, latencies[i]))
               for i in range(clients)]  # fmt: skip
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - started
    with grpcclient.InferenceServerClient(url) as client:
        after = client.get_inference_statistics("steps").model_stats[0]
    flat = np.array([x for one in latencies for x in one]) * 1000
    executions = after.execution_count - before.execution_count
    inferences = after.inference_count - before.inference_count
    return {
        "requests_s": flat.size / elapsed,
        "p50_ms": float(np.percentile(flat, 50)),
        "p99_ms": float(np.percentile(flat, 99)),
        "mean_batch": inferences / executions if executions else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", default="dlserve,triton")
    parser.add_argument("--clients", default="1,8")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--duration", type=float, default=5.0)
    args = parser.parse_args()
    rows = []
    for name in args.servers.split(","):
        with RUNNERS[name](MODELS, *_triton.free_ports(3)) as server:
            for clients in (int(c) for c in args.clients.split(",")):
                row = measure(server.grpc_url, clients, args.steps, args.duration)
                rows.append((name, clients, row))
                print(f"# {name} {clients} {row}", file=sys.stderr)
    print(f"{'server':<8} {'clients':>7} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'batch':>6}")
    for name, clients, row in rows:
        print(f"{name:<8} {clients:>7} {row['requests_s']:>8.1f} {row['p50_ms']:>8.1f} "
              f"{row['p99_ms']:>8.1f} {row['mean_batch']:>6.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
