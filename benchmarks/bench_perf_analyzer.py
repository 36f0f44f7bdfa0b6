"""dlserve next to the real Triton 2.51, measured with Triton's own load generator.

``perf_analyzer`` 2.51 (C++, from the tritonclient 2.51.0 wheel: ``_perf_analyzer.py``)
drives each server in turn on the same model repository; the servers alternate within one
run (round r starts with dlserve when r is even, with Triton when it is odd), and every
ratio is taken within a round, then the median over rounds reported: timings on a shared
machine drift by tens of percent within minutes, ratios within a round do not.

Cases (``--machine cpu``, the default, runs on any machine; ``--machine gpu`` adds the
GPU cases and needs a CUDA device):

- ``small``: ``add_sub`` (examples/models), two FP32 inputs of 16 elements, over gRPC and
  HTTP, 1 and 8 concurrent clients (``--concurrency-range``);
- ``shm4mb``: ``identity_4mb`` (benchmarks/models), 4 MB FP32 in and out through system
  shared memory (``--shared-memory system``), gRPC, 1 client;
- GPU: ``cuda_double`` (benchmarks/models_gpu, x*2 on the GPU) at [1,3,224,224] (0.6 MB)
  and [128,3,224,224] (77 MB) FP32 through CUDA shared memory in and out, gRPC, 1 and 8
  clients; and ``bls_gpu_pipeline`` (two GPU models called through BLS) against
  ``gpu_pipeline`` (the same two steps in one model), 0.6 MB, 1 client.

    .venv/bin/python benchmarks/bench_perf_analyzer.py [--machine cpu|gpu] [--rounds R]
        [--window-ms MS] [--cases small,shm4mb,...] [--servers dlserve,triton] [--json PATH]

Prints, per case, each server's p50 and throughput (medians over rounds), dlserve over
Triton (p50, and throughput at 8 clients) against its target, and the split perf_analyzer
reports (client send and receive; the server's queue, compute input, infer and output,
from the statistics extension), in microseconds. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _perf_analyzer  # siblings, not a package
import _triton

HERE = Path(__file__).resolve().parent
EXAMPLES = HERE.parent / "examples" / "models"
SPLIT = {  # perf_analyzer's CSV column -> our name (microseconds)
    "Client Send": "client_send",
    "Network+Server Send/Recv": "network",
    "Server Queue": "queue",
    "Server Compute Input": "compute_input",
    "Server Compute Infer": "compute_infer",
    "Server Compute Output": "compute_output",
    "Client Recv": "client_recv",
}


@dataclass(frozen=True)
class Case:
    """One perf_analyzer measurement, made against each server."""

    name: str
    model: str
    folder: Path  # the model's folder, copied into the run's repository
    protocol: str
    clients: int
    shapes: tuple[str, ...]
    shared_memory: str = "none"
    output_bytes: int = 0
    target: str = ""  # the ratio this case aims at, e.g. "p50 <= 0.8"
    needs: tuple[str, ...] = ()  # the models it calls (BLS), beside it in its folder

    @property
    def label(self) -> str:
        return f"{self.name} {self.protocol} c{self.clients}"


def _small(protocol: str, clients: int, target: str) -> Case:
    return Case("small", "add_sub", EXAMPLES / "add_sub", protocol, clients,
                ("INPUT0:16", "INPUT1:16"), target=target)  # fmt: skip


def _cuda(size: str, batch: int, clients: int, target: str) -> Case:
    return Case(f"cuda{size}", "cuda_double", HERE / "models_gpu" / "cuda_double", "grpc",
                clients, (f"INPUT_0:{batch},3,224,224",), "cuda", batch * 3 * 224 * 224 * 4,
                target)  # fmt: skip


def _pipeline(model: str, target: str, needs: tuple[str, ...] = ()) -> Case:
    return Case(model, model, HERE / "models_bls" / model, "grpc", 1, ("INPUT_0:1,3,224,224",),
                "cuda", 3 * 224 * 224 * 4, target, needs)  # fmt: skip


CPU_CASES = (
    _small("grpc", 1, "p50 <= 0.8"), _small("grpc", 8, "throughput >= 1.25"),
    _small("http", 1, "p50 <= 0.8"), _small("http", 8, "throughput >= 1.25"),
    Case("shm4mb", "identity_4mb", HERE / "models" / "identity_4mb", "grpc", 1,
         ("INPUT0:1048576",), "system", 4 * 1024 * 1024, "p50 <= 0.3"),
)  # fmt: skip
GPU_CASES = (
    _small("grpc", 1, "p50 <= 1.0"), _small("grpc", 8, "throughput >= 1.25"),
    _small("http", 1, "p50 <= 1.0"), _small("http", 8, "throughput >= 1.25"),
    _cuda("0.6MB", 1, 1, "p50 <= 0.7"), _cuda("0.6MB", 1, 8, "throughput >= 1.5"),
    _cuda("77MB", 128, 1, "p50 <= 0.35"), _cuda("77MB", 128, 8, ""),
    _pipeline("gpu_pipeline", ""),
    _pipeline("bls_gpu_pipeline", "BLS/single p50 <= 1.5", ("gpu_plus1", "gpu_times2")),
)  # fmt: skip


@dataclass
class Result:
    """perf_analyzer's report of one case against one server in one round."""

    case: str
    protocol: str
    clients: int
    server: str
    round: int
    p50_us: float | None = None
    p99_us: float | None = None
    throughput_rps: float | None = None
    split_us: dict[str, float] = field(default_factory=dict)
    error: str = ""


def repository_for(cases: list[Case], root: Path) -> Path:
    """One model repository holding every model the cases use (and the BLS steps)."""
    for case in cases:
        for folder in (case.folder, *(case.folder.parent / name for name in case.needs)):
            if not (root / folder.name).exists():
                shutil.copytree(folder, root / folder.name)
    return root


def command_for(binary: Path, case: Case, server: _triton.RunningServer, window_ms: int,
                stability: int, report: Path) -> list[str]:  # fmt: skip
    """The perf_analyzer command line of ``case`` against ``server``, its CSV to ``report``."""
    url = server.grpc_url if case.protocol == "grpc" else server.http_url
    command = [
        str(binary), "-m", case.model, "-u", url, "-i", case.protocol,
        "--concurrency-range", f"{case.clients}:{case.clients}",
        "--measurement-interval", str(window_ms), "--stability-percentage", str(stability),
        "--max-trials", "10", "--percentile", "50", "-f", str(report),
        *[arg for shape in case.shapes for arg in ("--shape", shape)],
    ]  # fmt: skip
    if case.shared_memory != "none":
        command += ["--shared-memory", case.shared_memory,
                    "--output-shared-memory-size", str(case.output_bytes)]  # fmt: skip
    return command


def run_case(binary: Path, case: Case, server: _triton.RunningServer,
             args: argparse.Namespace, round_: int) -> Result:  # fmt: skip
    result = Result(case.name, case.protocol, case.clients, server.name, round_)
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "report.csv"
        command = command_for(binary, case, server, args.window_ms, args.stability, report)
        done = subprocess.run(command, env=_perf_analyzer.environment(), capture_output=True,
                              text=True, timeout=600)  # fmt: skip
        if done.returncode != 0 or not report.exists():
            lines = (done.stdout + done.stderr).strip().splitlines()
            result.error = lines[-1] if lines else f"exit status {done.returncode}"
            return result
        with report.open() as source:
            (row,) = list(csv.DictReader(source))
    result.p50_us = float(row["p50 latency"])
    result.p99_us = float(row["p99 latency"])
    result.throughput_rps = float(row["Inferences/Second"])
    result.split_us = {ours: float(row[theirs]) for theirs, ours in SPLIT.items() if theirs in row}
    return result


@contextlib.contextmanager
def serving(
    name: str, repository: Path, dlserve_args: list[str]
) -> Iterator[_triton.RunningServer]:
    http, grpc, metrics = _triton.free_ports(3)
    if name == "dlserve":
        with _triton.run_dlserve(repository, http, grpc, metrics, *dlserve_args) as server:
            yield server
    else:
        with _triton.run_triton(repository, http, grpc, metrics) as server:
            yield server


def run(args: argparse.Namespace, cases: list[Case]) -> list[Result]:
    binary = _perf_analyzer.ensure_perf_analyzer()
    results: list[Result] = []
    with tempfile.TemporaryDirectory() as root:
        repository = repository_for(cases, Path(root))
        for round_ in range(args.rounds):
            order = args.servers if round_ % 2 == 0 else args.servers[::-1]
            for name in order:
                with serving(name, repository, args.dlserve_args.split()) as server:
                    for case in cases:
                        results.append(run_case(binary, case, server, args, round_))
                        print(f"# {round_} {name:<8} {case.label:<28} {brief(results[-1])}",
                              file=sys.stderr, flush=True)  # fmt: skip
    return results


def brief(result: Result) -> str:
    if result.error:
        return f"failed: {result.error}"
    return f"p50 {result.p50_us:.0f} us, {result.throughput_rps:.0f} req/s"


# --- the report ---------------------------------------------------------------------------
def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def of(results: list[Result], case: Case, server: str) -> list[Result]:
    return [r for r in results if r.case == case.name and r.protocol == case.protocol
            and r.clients == case.clients and r.server == server and not r.error]  # fmt: skip


def ratios(results: list[Result], case: Case, key: str) -> list[float]:
    """dlserve over Triton of ``key`` in each round where both were measured."""
    found = []
    for round_ in sorted({r.round for r in results}):
        ours = [getattr(r, key) for r in of(results, case, "dlserve") if r.round == round_]
        theirs = [getattr(r, key) for r in of(results, case, "triton") if r.round == round_]
        if ours and theirs and theirs[0]:
            found.append(ours[0] / theirs[0])
    return found


def summary(results: list[Result], cases: list[Case], servers: list[str]) -> list[dict[str, Any]]:
    rows = []
    for case in cases:
        row: dict[str, Any] = {"case": case.label, "target": case.target}
        for server in servers:
            mine = of(results, case, server)
            row[f"{server}_p50_us"] = median([r.p50_us for r in mine if r.p50_us is not None])
            row[f"{server}_rps"] = median([r.throughput_rps for r in mine if r.throughput_rps])
            row[f"{server}_split_us"] = {
                k: median([r.split_us[k] for r in mine if k in r.split_us]) for k in SPLIT.values()
            }
        row["p50_ratio"] = median(ratios(results, case, "p50_us"))
        row["throughput_ratio"] = median(ratios(results, case, "throughput_rps"))
        rows.append(row)
    return rows


def fmt(value: float | None, spec: str = ".0f") -> str:
    return "-" if value is None else format(value, spec)


def print_report(rows: list[dict[str, Any]], servers: list[str], rounds: int) -> None:
    head = f"{'case':<28}" + "".join(f"{s + ' p50':>14}{s + ' req/s':>15}" for s in servers)
    print(head + f"{'p50 ratio':>11}{'thr ratio':>11}  target (medians of {rounds} rounds)")
    for row in rows:
        cells = "".join(f"{fmt(row[f'{s}_p50_us']):>14}{fmt(row[f'{s}_rps']):>15}" for s in servers)
        ratio = f"{fmt(row['p50_ratio'], '.3f'):>11}{fmt(row['throughput_ratio'], '.3f'):>11}"
        print(f"{row['case']:<28}{cells}{ratio}  {row['target']}")
    print("\nsplit (us): client send / network+server / queue / compute input / infer / output"
          " / client recv")  # fmt: skip
    for row in rows:
        for server in servers:
            split = row[f"{server}_split_us"]
            print(
                f"{row['case']:<28} {server:<8} "
                + " / ".join(fmt(split[k]) for k in SPLIT.values())
            )
    pipeline = {r["case"].split()[0]: r for r in rows}
    if "bls_gpu_pipeline" in pipeline and "gpu_pipeline" in pipeline:
        for server in servers:
            bls, one = pipeline["bls_gpu_pipeline"], pipeline["gpu_pipeline"]
            if bls[f"{server}_p50_us"] and one[f"{server}_p50_us"]:
                print(f"{server}: BLS pipeline / single model p50 = "
                      f"{bls[f'{server}_p50_us'] / one[f'{server}_p50_us']:.2f}")  # fmt: skip


def versions() -> dict[str, str]:
    found = {"python": platform.python_version(), "perf_analyzer": _perf_analyzer.VERSION,
             "triton": f"2.51 (nvidia-pytriton {_triton.PYTRITON_VERSION})"}  # fmt: skip
    with contextlib.suppress(subprocess.CalledProcessError, FileNotFoundError):
        head = ["git", "rev-parse", "--short", "HEAD"]
        found["git"] = subprocess.run(head, cwd=HERE, capture_output=True, text=True,
                                      check=True).stdout.strip()  # fmt: skip
    return found


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--machine", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--servers", default="dlserve,triton", type=lambda t: t.split(","))
    parser.add_argument("--cases", type=lambda t: t.split(","),
                        help="the cases to run: small, shm4mb, cuda0.6MB, ...")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--window-ms", type=int, default=3000,
                        help="perf_analyzer's --measurement-interval")  # fmt: skip
    parser.add_argument("--stability", type=int, default=25,
                        help="perf_analyzer's --stability-percentage")  # fmt: skip
    parser.add_argument("--dlserve-args", default="", help="more `dlserve serve` options")
    parser.add_argument("--json", type=Path, help="also write the results here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cases = list(GPU_CASES if args.machine == "gpu" else CPU_CASES)
    if args.cases:
        cases = [c for c in cases if c.name in args.cases]
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    results = run(args, cases)
    rows = summary(results, cases, args.servers)
    print(f"{started}, {platform.node()}, {os.cpu_count()} CPUs, {versions()}")
    print_report(rows, args.servers, args.rounds)
    if args.json is not None:
        write_json(args.json, "bench_perf_analyzer", started, args, rows, results)


def write_json(path: Path, benchmark: str, started: str, args: argparse.Namespace,
               rows: list[dict[str, Any]], results: list[Result]) -> None:  # fmt: skip
    """The summary and every result, with the conditions they were measured under."""
    document = {
        "benchmark": benchmark, "date": started, "versions": versions(),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "settings": {"window_ms": args.window_ms, "rounds": args.rounds},
        "summary": rows, "results": [asdict(r) for r in results],
    }  # fmt: skip
    path.write_text(json.dumps(document, indent=2) + "\n")


if __name__ == "__main__":
    main()
