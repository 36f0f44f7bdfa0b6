"""Small-request latency and throughput: dlserve next to the real Triton server.

Each server in turn serves ``examples/models`` (the add_sub model) and is driven by
unmodified tritonclient over gRPC and HTTP, by 1 client and by 8 concurrent
clients. Every client is its own spawned process with its own
InferenceServerClient; all clients warm up, wait at a barrier, then send requests
back to back (one in flight per client) for a fixed count or a fixed time.

    .venv/bin/python benchmarks/bench_small.py [--servers dlserve,triton]
        [--requests N | --duration S] [--json PATH]

Prints p50 and p99 latency (microseconds, over all clients' requests), throughput
(requests/s: all requests over the span from the first start to the last end),
dlserve's p50 over Triton's for the same protocol and concurrency, and the CPU time
per request (user + system) of the clients, of the server process and of its workers
(Triton's Python stubs): on a machine with few cores their sum bounds the throughput. A benchmark,
not a test: it checks one answer per client and nothing else.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import multiprocessing
import multiprocessing.connection
import os
import platform
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _triton  # a sibling module, not a package

MODEL_NAME = "add_sub"
ELEMENTS = 16
BARRIER_TIMEOUT_S = 120.0
CELL_TIMEOUT_S = 600.0
RUNNERS: dict[str, Callable[..., contextlib.AbstractContextManager[_triton.RunningServer]]] = {
    "dlserve": _triton.run_dlserve,
    "triton": _triton.run_triton,
}


@dataclass(frozen=True)
class Workload:
    """What every client of one measurement does."""

    protocol: str  # "grpc" or "http"
    url: str
    requests: int | None  # per client; None: run for `duration_s`
    duration_s: float
    warmup_s: float


@dataclass(frozen=True)
class Row:
    """One measurement: a server, a protocol, a number of clients."""

    server: str
    protocol: str
    clients: int
    requests: int
    p50_us: float
    p99_us: float
    throughput_rps: float
    client_cpu_us: float  # CPU per request: the clients' own, all processes together
    server_cpu_us: float  # CPU per request: the server process itself
    worker_cpu_us: float  # CPU per request: its workers (dlserve) or Python stubs (Triton)


# --- client side (runs in spawned processes) -----------------------------------------


def make_infer(protocol: str, url: str) -> Callable[[], Any]:
    """A function that sends one add_sub request and returns its result object."""
    if protocol == "grpc":
        import tritonclient.grpc as client_module
    else:
        import tritonclient.http as client_module
    client = client_module.InferenceServerClient(url)
    rng = np.random.default_rng(os.getpid())
    arrays = [rng.random(ELEMENTS, dtype=np.float32) for _ in range(2)]
    inputs = [client_module.InferInput(f"INPUT{i}", [ELEMENTS], "FP32") for i in range(2)]
    for tensor, array in zip(inputs, arrays, strict=True):
        tensor.set_data_from_numpy(array)
    outputs = [client_module.InferRequestedOutput(f"OUTPUT{i}") for i in range(2)]
    check_answer(client.infer(MODEL_NAME, inputs, outputs=outputs), arrays)
    return lambda: client.infer(MODEL_NAME, inputs, outputs=outputs)


def check_answer(result: Any, arrays: list[np.ndarray]) -> None:
    """Fail loudly if the server computes something else than add_sub."""
    np.testing.assert_allclose(result.as_numpy("OUTPUT0"), arrays[0] + arrays[1])
    np.testing.assert_allclose(result.as_numpy("OUTPUT1"), arrays[0] - arrays[1])


def send_for(infer: Callable[[], Any], seconds: float) -> None:
    """Send requests back to back for ``seconds`` (warm-up)."""
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        infer()


def measure(infer: Callable[[], Any], workload: Workload) -> list[int]:
    """Latencies (ns) of back-to-back requests, by count or until a deadline."""
    latencies: list[int] = []
    deadline = time.perf_counter_ns() + int(workload.duration_s * 1e9)
    while True:
        if workload.requests is not None and len(latencies) >= workload.requests:
            break
        start = time.perf_counter_ns()
        if workload.requests is None and start >= deadline:
            break
        infer()
        latencies.append(time.perf_counter_ns() - start)
    return latencies


def client_main(workload: Workload, barrier: Barrier, result_path: str) -> None:
    """One client process: connect, warm up, wait for the others, measure, report."""
    infer = make_infer(workload.protocol, workload.url)
    send_for(infer, workload.warmup_s)
    barrier.wait(BARRIER_TIMEOUT_S)
    start_ns = time.perf_counter_ns()  # CLOCK_MONOTONIC: comparable across processes
    start_cpu = time.process_time()
    latencies = measure(infer, workload)
    report = {
        "start_ns": start_ns,
        "end_ns": time.perf_counter_ns(),
        "cpu_s": time.process_time() - start_cpu,  # this client's own CPU (user + system)
        "latencies_ns": latencies,
    }
    Path(result_path).write_text(json.dumps(report))


# --- orchestration ------------------------------------------------------------------------


def run_clients(
    workload: Workload, clients: int, server_pid: int
) -> tuple[list[dict[str, Any]], tuple[float, float]]:
    """Run ``clients`` spawned client processes; their reports, and the server's CPU.

    The server's CPU (its own process, and all its descendants: workers, Triton's Python
    stubs) is read when every client has warmed up and again when they have all ended.
    """
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(clients + 1)  # the clients, and this process reading the CPU
    with tempfile.TemporaryDirectory(prefix="bench-small-") as folder:
        paths = [os.path.join(folder, f"client{i}.json") for i in range(clients)]
        processes = [
            context.Process(target=client_main, args=(workload, barrier, path)) for path in paths
        ]
        for process in processes:
            process.start()
        before = (0.0, 0.0)
        with contextlib.suppress(threading.BrokenBarrierError):  # wait_clients says why
            barrier.wait(BARRIER_TIMEOUT_S)
            before = tree_cpu_s(server_pid)
        wait_clients(processes, barrier)
        after = tree_cpu_s(server_pid)
        server_cpu_s = (after[0] - before[0], after[1] - before[1])
        return [json.loads(Path(path).read_text()) for path in paths], server_cpu_s


def wait_clients(processes: Sequence[BaseProcess], barrier: Barrier) -> None:
    """Join the clients; on the first failure release the barrier and stop the rest."""
    deadline = time.monotonic() + CELL_TIMEOUT_S
    pending: dict[int, BaseProcess] = {process.sentinel: process for process in processes}
    while pending and time.monotonic() < deadline:
        ready = multiprocessing.connection.wait(list(pending), timeout=1.0)
        finished = [pending.pop(sentinel) for sentinel in ready if isinstance(sentinel, int)]
        for process in finished:
            process.join()  # the sentinel fires at exit; the exit code needs the reap
        if any(process.exitcode != 0 for process in finished):
            break
    barrier.abort()  # wakes clients still at the barrier when another one failed
    for process in processes:
        if process.is_alive():
            process.kill()
        process.join()
    failed = [process.exitcode for process in processes if process.exitcode != 0]
    if failed:
        raise RuntimeError(f"{len(failed)} client(s) failed or timed out, exit codes {failed}")


def tree_cpu_s(pid: int) -> tuple[float, float]:
    """CPU seconds (user + system) used so far by a process, and by all its descendants."""
    import psutil

    def used(process: psutil.Process) -> float:
        with contextlib.suppress(psutil.NoSuchProcess):
            times = process.cpu_times()
            return float(times.user + times.system)
        return 0.0

    root = psutil.Process(pid)
    return used(root), sum(used(child) for child in root.children(recursive=True))


def summarize(
    server: str,
    workload: Workload,
    reports: list[dict[str, Any]],
    server_cpu_s: tuple[float, float],
) -> Row:
    """Pool all clients' latencies into one row."""
    latencies_us = np.concatenate([r["latencies_ns"] for r in reports]) / 1000.0
    span_s = (max(r["end_ns"] for r in reports) - min(r["start_ns"] for r in reports)) / 1e9
    count = latencies_us.size
    return Row(
        server=server,
        protocol=workload.protocol,
        clients=len(reports),
        requests=int(latencies_us.size),
        p50_us=float(np.percentile(latencies_us, 50)),
        p99_us=float(np.percentile(latencies_us, 99)),
        throughput_rps=count / span_s,
        client_cpu_us=sum(r["cpu_s"] for r in reports) / count * 1e6,
        server_cpu_us=server_cpu_s[0] / count * 1e6,
        worker_cpu_us=server_cpu_s[1] / count * 1e6,
    )


def server_version(server: _triton.RunningServer) -> str:
    """``name version`` from the server metadata endpoint (GET /v2)."""
    with urllib.request.urlopen(f"http://{server.http_url}/v2", timeout=5.0) as response:
        metadata = json.load(response)
    return f"{metadata.get('name', '?')} {metadata.get('version', '?')}"


def bench_server(name: str, args: argparse.Namespace) -> tuple[str, list[Row]]:
    """Start one server, run every protocol x concurrency against it, stop it."""
    rows = []
    extra = args.dlserve_args.split() if name == "dlserve" else []
    with RUNNERS[name](args.model_repository, *_triton.free_ports(3), *extra) as server:
        version = server_version(server)
        print(f"# {name}: {version}", file=sys.stderr)
        for protocol in args.protocols:
            url = server.grpc_url if protocol == "grpc" else server.http_url
            workload = Workload(protocol, url, args.requests, args.duration, args.warmup)
            for clients in args.clients:
                reports, server_cpu_s = run_clients(workload, clients, server.process.pid)
                rows.append(summarize(name, workload, reports, server_cpu_s))
                print(f"#   {format_row(rows[-1], None)}", file=sys.stderr)
    return version, rows


# --- output ---------------------------------------------------------------------------------

HEADER = (
    f"{'server':<8} {'proto':<5} {'clients':>7} {'requests':>9} "
    f"{'p50 us':>9} {'p99 us':>9} {'req/s':>9} {'p50 vs triton':>14} "
    f"{'cpu us: client':>14} {'server':>7} {'worker':>7}"
)


def p50_ratio(row: Row, rows: list[Row]) -> float | None:
    """This row's p50 over Triton's p50 for the same protocol and clients."""
    for other in rows:
        if (other.server, other.protocol, other.clients) == ("triton", row.protocol, row.clients):
            return row.p50_us / other.p50_us
    return None


def format_row(row: Row, ratio: float | None) -> str:
    """One line of the results table."""
    ratio_text = "-" if ratio is None else f"{ratio:.2f}x"
    return (
        f"{row.server:<8} {row.protocol:<5} {row.clients:>7} {row.requests:>9} "
        f"{row.p50_us:>9.0f} {row.p99_us:>9.0f} {row.throughput_rps:>9.0f} {ratio_text:>14} "
        f"{row.client_cpu_us:>14.0f} {row.server_cpu_us:>7.0f} {row.worker_cpu_us:>7.0f}"
    )


def print_table(rows: list[Row]) -> None:
    """The results, one line per server/protocol/concurrency."""
    print(HEADER)
    for row in rows:
        print(format_row(row, p50_ratio(row, rows)))


def write_json(
    path: Path, args: argparse.Namespace, versions: dict[str, str], rows: list[Row]
) -> None:
    """The results and the conditions they were measured under."""
    document = {
        "benchmark": "bench_small",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "settings": {
            "model": MODEL_NAME,
            "elements": ELEMENTS,
            "requests_per_client": args.requests,
            "duration_s": None if args.requests else args.duration,
            "warmup_s": args.warmup,
        },
        "servers": versions,
        "results": [asdict(row) | {"p50_vs_triton": p50_ratio(row, rows)} for row in rows],
    }
    path.write_text(json.dumps(document, indent=2) + "\n")


# --- command line -----------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Options; lists are comma-separated."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", default="dlserve,triton", type=comma_list)
    parser.add_argument("--protocols", default="grpc,http", type=comma_list)
    parser.add_argument("--clients", default="1,8", type=lambda s: [int(x) for x in comma_list(s)])
    parser.add_argument("--requests", type=int, help="requests per client (instead of --duration)")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per measurement")
    parser.add_argument("--warmup", type=float, default=1.0, help="warm-up seconds per client")
    parser.add_argument(
        "--model-repository", type=Path, default=_triton.REPO_ROOT / "examples" / "models"
    )
    parser.add_argument("--dlserve-args", default="", help="more `dlserve serve` options")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    unknown = set(args.servers) - RUNNERS.keys() or set(args.protocols) - {"grpc", "http"}
    if unknown:
        parser.error(f"unknown server or protocol: {', '.join(sorted(unknown))}")
    return args


def comma_list(text: str) -> list[str]:
    """``"a, b"`` -> ``["a", "b"]``."""
    return [part.strip() for part in text.split(",") if part.strip()]


def main(argv: list[str] | None = None) -> None:
    """Benchmark each server in turn, then print (and optionally save) the table."""
    args = parse_args(argv)
    versions: dict[str, str] = {}
    rows: list[Row] = []
    for name in args.servers:
        versions[name], server_rows = bench_server(name, args)
        rows.extend(server_rows)
    print_table(rows)
    if args.json is not None:
        write_json(args.json, args, versions, rows)


if __name__ == "__main__":
    main()
