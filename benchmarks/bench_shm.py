"""A 4 MB FP32 tensor in and out: through system shared memory, and over the wire.

Each server in turn (dlserve, then the real Triton 2.51) serves ``benchmarks/models``
(the ``identity_4mb`` model: output = input) and is driven by unmodified
tritonclient.grpc, one client, one request in flight:

- ``shm``: the input and the output live in system shared-memory regions the client
  registered once (``tritonclient.utils.shared_memory``); requests carry no tensor bytes;
- ``wire``: the input goes in the request (raw_input_contents), the output comes back in
  the response.

    .venv/bin/python benchmarks/bench_shm.py [--servers dlserve,triton]
        [--requests N | --duration S] [--rounds R] [--paths shm,wire] [--json PATH]

Prints p50 and p99 latency (microseconds) per server and path, and the ratio it is
judged by: dlserve's shared-memory p50 over Triton's (target: at most 0.3). A benchmark,
not a test: it checks one answer per server and path and nothing else.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _triton  # a sibling module, not a package

MODEL_NAME = "identity_4mb"
ELEMENTS = 1024 * 1024  # 4 MB of FP32
NBYTES = ELEMENTS * 4
TARGET_RATIO = 0.3
MODELS = Path(__file__).resolve().parent / "models"
RUNNERS = {"dlserve": _triton.run_dlserve, "triton": _triton.run_triton}


@dataclass(frozen=True)
class Row:
    server: str
    path: str  # "shm" or "wire"
    requests: int
    p50_us: float
    p99_us: float
    round: int = 0  # --rounds: the servers take turns, each round measures both


# --- the two ways to send a request -----------------------------------------------------


@contextlib.contextmanager
def shm_infer(client: Any, data: np.ndarray) -> Iterator[Callable[[], Any]]:
    """A function sending one request whose input and output are in registered regions."""
    import tritonclient.grpc as grpcclient
    import tritonclient.utils.shared_memory as shm

    tag = f"bench_shm_{os.getpid()}_{time.monotonic_ns()}"
    handles = [shm.create_shared_memory_region(f"{tag}_{n}", f"/{tag}_{n}", NBYTES)
               for n in ("in", "out")]  # fmt: skip
    try:
        for name in ("in", "out"):
            client.register_system_shared_memory(f"{tag}_{name}", f"/{tag}_{name}", NBYTES)
        shm.set_shared_memory_region(handles[0], [data])
        tensor = grpcclient.InferInput("INPUT0", [ELEMENTS], "FP32")
        tensor.set_shared_memory(f"{tag}_in", NBYTES)
        output = grpcclient.InferRequestedOutput("OUTPUT0")
        output.set_shared_memory(f"{tag}_out", NBYTES)
        client.infer(MODEL_NAME, [tensor], outputs=[output])
        answer = shm.get_contents_as_numpy(handles[1], np.float32, [ELEMENTS])
        np.testing.assert_array_equal(answer, data)
        yield lambda: client.infer(MODEL_NAME, [tensor], outputs=[output])
    finally:
        from tritonclient.utils import InferenceServerException

        try:
            client.unregister_system_shared_memory()
        except InferenceServerException as exc:  # Triton 2.51 sometimes refuses; it stops next
            print(f"#   unregister failed: {exc}", file=sys.stderr)
        for handle in handles:
            shm.destroy_shared_memory_region(handle)


@contextlib.contextmanager
def wire_infer(client: Any, data: np.ndarray) -> Iterator[Callable[[], Any]]:
    """A function sending one request with the input in it; the output comes back in it."""
    import tritonclient.grpc as grpcclient

    tensor = grpcclient.InferInput("INPUT0", [ELEMENTS], "FP32")
    tensor.set_data_from_numpy(data)
    output = grpcclient.InferRequestedOutput("OUTPUT0")
    np.testing.assert_array_equal(
        client.infer(MODEL_NAME, [tensor], outputs=[output]).as_numpy("OUTPUT0"), data
    )
    yield lambda: client.infer(MODEL_NAME, [tensor], outputs=[output]).as_numpy("OUTPUT0")


PATHS = {"shm": shm_infer, "wire": wire_infer}


# --- measuring ------------------------------------------------------------------------------


def measure(infer: Callable[[], Any], args: argparse.Namespace) -> list[int]:
    """Latencies (ns) of back-to-back requests after a warm-up, by count or for a time."""
    deadline = time.perf_counter() + args.warmup
    while time.perf_counter() < deadline:
        infer()
    latencies: list[int] = []
    deadline = time.perf_counter() + args.duration
    while len(latencies) < (args.requests or sys.maxsize):
        start = time.perf_counter_ns()
        if args.requests is None and start / 1e9 >= deadline:
            break
        infer()
        latencies.append(time.perf_counter_ns() - start)
    return latencies


def bench_server(name: str, args: argparse.Namespace, round_: int = 0) -> list[Row]:
    """Start one server, measure both paths against it, stop it."""
    import tritonclient.grpc as grpcclient

    rows = []
    data = np.random.default_rng(1).standard_normal(ELEMENTS).astype(np.float32)
    extra = args.dlserve_args.split() if name == "dlserve" else []
    with RUNNERS[name](MODELS, *_triton.free_ports(3), *extra) as server:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        for path in args.paths:
            with PATHS[path](client, data) as infer:
                latencies_us = np.array(measure(infer, args)) / 1000.0
            rows.append(Row(name, path, int(latencies_us.size),
                            float(np.percentile(latencies_us, 50)),
                            float(np.percentile(latencies_us, 99)), round_))  # fmt: skip
            print(f"#   {format_row(rows[-1])}", file=sys.stderr)
        client.close()
    return rows


# --- output ---------------------------------------------------------------------------------


def format_row(row: Row) -> str:
    return (
        f"{row.round:>5} {row.server:<8} {row.path:<5} {row.requests:>9} {row.p50_us:>10.0f} "
        f"{row.p99_us:>10.0f}"
    )


def round_ratios(rows: list[Row]) -> list[float]:
    """Per round: dlserve's shared-memory p50 over Triton's, where both were measured."""
    ratios = []
    for round_ in sorted({row.round for row in rows}):
        p50 = {r.server: r.p50_us for r in rows if r.path == "shm" and r.round == round_}
        if "dlserve" in p50 and "triton" in p50:
            ratios.append(p50["dlserve"] / p50["triton"])
    return ratios


def shm_ratio(rows: list[Row]) -> float | None:
    """The median of the rounds' ratios (the one ratio with a single round)."""
    ratios = round_ratios(rows)
    return float(np.median(ratios)) if ratios else None


def report(rows: list[Row]) -> None:
    print(f"{'round':>5} {'server':<8} {'path':<5} {'requests':>9} {'p50 us':>10} {'p99 us':>10}")
    for row in rows:
        print(format_row(row))
    ratios = round_ratios(rows)
    if ratios:
        print("rounds: " + ", ".join(f"{r:.3f}" for r in ratios))
        ratio = float(np.median(ratios))
        verdict = "ok" if ratio <= TARGET_RATIO else "ABOVE TARGET"
        print(
            f"dlserve_shm_p50 / triton_shm_p50 = {ratio:.3f} (median of {len(ratios)} round(s); "
            f"target <= {TARGET_RATIO}: {verdict})"
        )


def write_json(path: Path, args: argparse.Namespace, rows: list[Row]) -> None:
    document = {
        "benchmark": "bench_shm",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "settings": {
            "model": MODEL_NAME,
            "bytes": NBYTES,
            "protocol": "grpc",
            "clients": 1,
            "requests": args.requests,
            "duration_s": args.duration,
            "warmup_s": args.warmup,
            "rounds": args.rounds,
        },
        "results": [asdict(row) for row in rows],
        "round_ratios": round_ratios(rows),
        "dlserve_shm_p50_over_triton_shm_p50": shm_ratio(rows),
    }
    path.write_text(json.dumps(document, indent=2) + "\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", default="dlserve,triton", type=_comma_list)
    parser.add_argument("--paths", default="shm,wire", type=_comma_list)
    parser.add_argument("--requests", type=int, help="requests per measurement")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per measurement")
    parser.add_argument("--warmup", type=float, default=1.0, help="warm-up seconds")
    parser.add_argument("--dlserve-args", default="", help="more `dlserve serve` options")
    parser.add_argument(
        "--rounds", type=int, default=1,
        help="the servers take turns this many times (the VM's speed drifts: each round's "
        "ratio is taken within the round, and the median reported)",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    if set(args.servers) - RUNNERS.keys() or set(args.paths) - PATHS.keys():
        parser.error("unknown server or path")
    return args


def _comma_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rows = [
        row
        for round_ in range(args.rounds)
        for name in args.servers
        for row in bench_server(name, args, round_)
    ]
    report(rows)
    if args.json is not None:
        write_json(args.json, args, rows)


if __name__ == "__main__":
    main()
