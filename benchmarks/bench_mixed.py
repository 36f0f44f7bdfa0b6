"""Small requests and 4 MB uploads at once: what each load costs the other, next to Triton.

Two loads on one gRPC port, each driven by ``perf_analyzer`` 2.51 (``_perf_analyzer.py``):

- ``small``: ``add_sub`` (examples/models), two FP32 inputs of 16 elements, 8 clients;
- ``wire4mb``: ``identity_4mb`` (benchmarks/models), 4 MB FP32 in the request and 4 MB
  back in the response (no shared memory: the bytes cross the connection), 4 clients.

Each server in turn (the order alternating by round, as in ``bench_perf_analyzer.py``)
has each load measured alone, then again while a second perf_analyzer keeps the other
load going (started first, and measured only once the server has executed some of its
requests). Reported per server, load and round: p50, p99 and throughput alone and with
the other load, and with/alone. The server decides who waits: a loop that handles
an upload's bytes as they come serves the uploads fast and the small clients late; one
that puts small requests first does the opposite. A benchmark, not a test.

    .venv/bin/python benchmarks/bench_mixed.py [--rounds R] [--window-ms MS]
        [--servers dlserve,triton] [--dlserve-args ...] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _perf_analyzer  # siblings, not a package
import _triton
import bench_perf_analyzer as pa

SMALL = pa.Case("small", "add_sub", pa.EXAMPLES / "add_sub", "grpc", 8, ("INPUT0:16", "INPUT1:16"))
WIRE = pa.Case("wire4mb", "identity_4mb", pa.HERE / "models" / "identity_4mb", "grpc", 4,
               ("INPUT0:1048576",))  # fmt: skip
LOADS = (SMALL, WIRE)
BACKGROUND_WINDOW_MS = 3_600_000  # the other load's perf_analyzer runs until stopped
STARTED_TIMEOUT_S = 60.0


def executed(server: _triton.RunningServer, model: str) -> int:
    """Requests of ``model`` the server has answered (the statistics extension)."""
    url = f"http://{server.http_url}/v2/models/{model}/stats"
    with urllib.request.urlopen(url, timeout=5.0) as response:
        stats = json.load(response)["model_stats"]
    return sum(int(entry["inference_stats"]["success"]["count"]) for entry in stats)


@contextlib.contextmanager
def background(binary: Path, case: pa.Case, server: _triton.RunningServer) -> Iterator[None]:
    """``case``'s load kept going for the block, which starts once the server has answered
    a few rounds of it."""
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "background.csv"
        command = pa.command_for(binary, case, server, BACKGROUND_WINDOW_MS, 999, report)
        process = subprocess.Popen(command, env=_perf_analyzer.environment(),
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                   start_new_session=True)  # fmt: skip
        try:
            before, deadline = executed(server, case.model), time.monotonic() + STARTED_TIMEOUT_S
            while executed(server, case.model) < before + 4 * case.clients:
                if process.poll() is not None or time.monotonic() > deadline:
                    error = process.stderr.read().decode() if process.stderr else ""
                    raise RuntimeError(f"the {case.name} load did not start: {error[-500:]}")
                time.sleep(0.05)
            yield
        finally:
            _triton.stop_process(process, timeout_s=10.0)  # a group of its own: its session


def run(args: argparse.Namespace) -> list[pa.Result]:
    """Every server, round and load, alone and under the other load."""
    binary = _perf_analyzer.ensure_perf_analyzer()
    results: list[pa.Result] = []
    with tempfile.TemporaryDirectory() as root:
        repository = pa.repository_for(list(LOADS), Path(root))
        for round_ in range(args.rounds):
            order = args.servers if round_ % 2 == 0 else args.servers[::-1]
            for name in order:
                with pa.serving(name, repository, args.dlserve_args.split()) as server:
                    for case, other in ((SMALL, WIRE), (WIRE, SMALL)):
                        results.append(pa.run_case(binary, case, server, args, round_))
                        with background(binary, other, server):
                            mixed = pa.run_case(binary, case, server, args, round_)
                        results.append(replace(mixed, case=f"{case.name}+{other.name}"))
                        for result in results[-2:]:
                            print(f"# {round_} {name:<8} {result.case:<16} {pa.brief(result)}",
                                  file=sys.stderr, flush=True)  # fmt: skip
    return results


def summary(results: list[pa.Result], servers: list[str]) -> list[dict[str, Any]]:
    """Per server and load: medians over rounds alone and mixed, and of each round's
    mixed/alone ratios."""
    rows = []
    for server in servers:
        for case, other in ((SMALL, WIRE), (WIRE, SMALL)):
            row: dict[str, Any] = {"server": server, "load": f"{case.name} c{case.clients}",
                                   "with": f"{other.name} c{other.clients}"}  # fmt: skip
            for label, name in (("alone", case.name), ("mixed", f"{case.name}+{other.name}")):
                mine = [r for r in results if r.server == server and r.case == name and not r.error]
                for key in ("p50_us", "p99_us", "throughput_rps"):
                    row[f"{label}_{key}"] = pa.median([getattr(r, key) for r in mine])
            for key in ("p99_us", "throughput_rps"):
                ratios = []
                for round_ in sorted({r.round for r in results}):
                    pair = {r.case: getattr(r, key) for r in results if r.server == server
                            and r.round == round_ and not r.error}  # fmt: skip
                    alone, mixed = pair.get(case.name), pair.get(f"{case.name}+{other.name}")
                    if alone and mixed:
                        ratios.append(mixed / alone)
                row[f"{key}_mixed_over_alone"] = statistics.median(ratios) if ratios else None
            rows.append(row)
    return rows


def print_report(rows: list[dict[str, Any]], rounds: int) -> None:
    f = pa.fmt
    print(
        f"{'server':<9}{'load':<12}{'with':<13}{'p50 us':>16}{'p99 us':>16}{'req/s':>14}"
        f"{'p99 ratio':>11}{'req/s ratio':>12}  (alone / mixed, medians of {rounds} rounds)"
    )
    for row in rows:
        cells = "".join(
            f"{f(row['alone_' + key]) + ' / ' + f(row['mixed_' + key]):>16}"
            for key in ("p50_us", "p99_us")
        )
        rate = f"{f(row['alone_throughput_rps']) + ' / ' + f(row['mixed_throughput_rps']):>14}"
        ratios = (f"{f(row['p99_us_mixed_over_alone'], '.2f'):>11}"
                  f"{f(row['throughput_rps_mixed_over_alone'], '.2f'):>12}")  # fmt: skip
        print(f"{row['server']:<9}{row['load']:<12}{row['with']:<13}{cells}{rate}{ratios}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", default="dlserve,triton", type=lambda t: t.split(","))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--window-ms", type=int, default=3000,
                        help="perf_analyzer's --measurement-interval")  # fmt: skip
    parser.add_argument("--stability", type=int, default=999,
                        help="perf_analyzer's --stability-percentage (999: the first three"
                        " windows, merged; two loads at once are seldom within 25%%)")  # fmt: skip
    parser.add_argument("--dlserve-args", default="", help="more `dlserve serve` options")
    parser.add_argument("--json", type=Path, help="also write the results here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    results = run(args)
    rows = summary(results, args.servers)
    print(f"{started}, {platform.node()}, {os.cpu_count()} CPUs, {pa.versions()}")
    print_report(rows, args.rounds)
    if args.json is not None:
        pa.write_json(args.json, "bench_mixed", started, args, rows, results)


if __name__ == "__main__":
    main()
