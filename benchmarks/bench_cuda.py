"""GPU tensors through CUDA shared memory, end to end (needs a GPU).

dlserve serves ``benchmarks/models_gpu`` (``cuda_double``: OUTPUT_0 = INPUT_0 * 2 on the
GPU through DLPack). Each client is a separate process with unmodified tritonclient.grpc;
its input and output live in CUDA shared-memory regions it registered once
(``tritonclient.utils.cuda_shared_memory``), so requests carry no tensor bytes. Sizes:
fp32 [1,3,224,224] (0.6 MB) and [128,3,224,224] (77 MB); 1 client (p50, p99), then N
concurrent clients (throughput).

    python benchmarks/bench_cuda.py [--duration S] [--clients 1,4,8] [--busy-poll-us US] [--mps]
        [--json PATH]

The reference is Triton 2.51's Python backend on the same kind of machine (an H200):
p50 947 us (0.6 MB) and 2707 us (77 MB) at 1 client, 2078 req/s
(0.6 MB, 8 clients) and 408 req/s (77 MB, 4 clients). Targets: dlserve's p50 at most 1/3 of
Triton's, its throughput at least 1.5x. A benchmark, not a test: it checks one answer per
client and nothing else.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _triton  # a sibling module, not a package

MODELS = Path(__file__).resolve().parent / "models_gpu"
MODEL = "cuda_double"
SIZES = {"0.6MB": [1, 3, 224, 224], "77MB": [128, 3, 224, 224], "48B": [1, 3, 2, 2]}
TRITON = {  # size -> (p50 us at 1 client, req/s, clients) Triton 2.51 on an H200
    "0.6MB": (947.0, 2078.0, 8),
    "77MB": (2707.0, 408.0, 4),
    "48B": (float("nan"), float("nan"), 0),  # no reference: dlserve's floor for this path
}


@dataclass(frozen=True)
class Row:
    size: str
    clients: int
    requests: int
    p50_us: float
    p99_us: float
    throughput: float  # requests per second, all clients together


def client_process(url: str, shape: list[int], seconds: float, warmup: float, start: Any,
                   results: Any) -> None:  # fmt: skip
    """One client: its own regions, a warm-up, then requests back to back until the end."""
    import tritonclient.grpc as grpcclient
    import tritonclient.utils.cuda_shared_memory as cudashm

    client = grpcclient.InferenceServerClient(url)
    nbytes = int(np.prod(shape)) * 4
    tag = f"bench_{os.getpid()}"
    regions = [cudashm.create_shared_memory_region(f"{tag}_{n}", nbytes, 0) for n in "io"]
    try:
        for name, region in zip(("in", "out"), regions, strict=True):
            client.register_cuda_shared_memory(
                f"{tag}_{name}", cudashm.get_raw_handle(region), 0, nbytes
            )
        data = np.random.default_rng(os.getpid()).standard_normal(shape).astype(np.float32)
        cudashm.set_shared_memory_region(regions[0], [data])
        tensor = grpcclient.InferInput("INPUT_0", shape, "FP32")
        tensor.set_shared_memory(f"{tag}_in", nbytes)
        output = grpcclient.InferRequestedOutput("OUTPUT_0")
        output.set_shared_memory(f"{tag}_out", nbytes)
        client.infer(MODEL, [tensor], outputs=[output])
        got = cudashm.get_contents_as_numpy(regions[1], np.float32, shape)
        np.testing.assert_array_equal(got, data * 2)
        deadline = time.perf_counter() + warmup
        while time.perf_counter() < deadline:
            client.infer(MODEL, [tensor], outputs=[output])
        start.wait()
        latencies = []
        deadline = time.perf_counter() + seconds
        while (now := time.perf_counter()) < deadline:
            client.infer(MODEL, [tensor], outputs=[output])
            latencies.append(time.perf_counter() - now)
        results.put(latencies)
    finally:
        for name in ("in", "out"):  # its own: the other clients' are still in use
            client.unregister_cuda_shared_memory(f"{tag}_{name}")
        for region in regions:
            cudashm.destroy_shared_memory_region(region)
        client.close()


def measure(url: str, size: str, clients: int, args: argparse.Namespace) -> Row:
    context = multiprocessing.get_context("spawn")
    start = context.Barrier(clients + 1)
    results = context.Queue()
    processes = [
        context.Process(target=client_process,
                        args=(url, SIZES[size], args.duration, args.warmup, start, results))
        for _ in range(clients)
    ]  # fmt: skip
    for process in processes:
        process.start()
    start.wait()
    began = time.perf_counter()
    latencies = [x for _ in processes for x in results.get(timeout=300)]
    elapsed = time.perf_counter() - began
    for process in processes:
        process.join(timeout=60)
    micros = np.array(latencies) * 1e6
    p50, p99 = (float(np.percentile(micros, q)) for q in (50, 99))
    return Row(size, clients, micros.size, p50, p99, micros.size / max(elapsed, args.duration))


def server_side(url: str) -> dict[str, float]:
    """The server's cumulative statistics for the model (ns) and its request count."""
    import tritonclient.grpc as grpcclient

    with grpcclient.InferenceServerClient(url) as client:
        stats = client.get_inference_statistics(MODEL).model_stats[0]
    parts = ("success", "queue", "compute_input", "compute_infer", "compute_output")
    totals = {part: float(getattr(stats.inference_stats, part).ns) for part in parts}
    totals["count"] = float(stats.inference_stats.success.count)
    return totals


def print_server_side(before: dict[str, float], after: dict[str, float]) -> None:
    """Where a request's time went inside the server, on average, in microseconds."""
    count = after["count"] - before["count"]
    if count:
        parts = [f"{k} {(after[k] - before[k]) / count / 1000:.0f}" for k in before if k != "count"]
        print(f"#   server-side us per request: {', '.join(parts)}", file=sys.stderr, flush=True)


def report(rows: list[Row]) -> None:
    print(f"{'size':<6} {'clients':>7} {'requests':>9} {'p50 us':>9} {'p99 us':>9} {'req/s':>9}"
          f"  vs Triton 2.51 (reference numbers, H200)")  # fmt: skip
    for row in rows:
        p50_ref, rate_ref, ref_clients = TRITON[row.size]
        if row.clients == 1:
            versus = f"p50 ratio {row.p50_us / p50_ref:.3f} (target <= 0.333)"
        elif row.clients == ref_clients:
            versus = f"throughput ratio {row.throughput / rate_ref:.2f}x (target >= 1.5x)"
        else:
            versus = ""
        print(f"{row.size:<6} {row.clients:>7} {row.requests:>9} {row.p50_us:>9.0f} "
              f"{row.p99_us:>9.0f} {row.throughput:>9.0f}  {versus}")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per measurement")
    parser.add_argument("--warmup", type=float, default=1.0, help="warm-up seconds")
    parser.add_argument("--sizes", default="0.6MB,77MB")
    parser.add_argument("--clients", default="1,4,8", help="client counts to measure")
    parser.add_argument("--busy-poll-us", type=int, default=0, help="dlserve's --busy-poll-us")
    parser.add_argument("--mps", action="store_true", help="dlserve's --mps")
    parser.add_argument("--dlserve-args", default="", help="more `dlserve serve` options")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    rows = []
    extra = ("--busy-poll-us", str(args.busy_poll_us), *(["--mps"] if args.mps else []),
             *args.dlserve_args.split())  # fmt: skip
    with _triton.run_dlserve(MODELS, *_triton.free_ports(3), *extra) as server:
        for size in args.sizes.split(","):
            for clients in (int(c) for c in args.clients.split(",")):
                before = server_side(server.grpc_url)
                rows.append(measure(server.grpc_url, size, clients, args))
                print(f"# {asdict(rows[-1])}", file=sys.stderr, flush=True)
                print_server_side(before, server_side(server.grpc_url))
    report(rows)
    if args.json is not None:
        document = {
            "benchmark": "bench_cuda",
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
            "reference": {
                "server": "Triton 2.51 Python backend (reference numbers, H200)",
                "numbers": TRITON,
            },
            "results": [asdict(row) for row in rows],
        }
        args.json.write_text(json.dumps(document, indent=2) + "\n")


if __name__ == "__main__":
    main()
