"""Run one benchmark of ``benchmarks/`` from two checkouts of dlserve in turn, and compare.

Timings on a shared machine drift by tens of percent within minutes, so the two versions
are interleaved: round r runs the benchmark from checkout A, then from checkout B (each
starts its own server from its own ``src/``), R rounds. The benchmark must take ``--json
PATH`` (bench_small, bench_shm); every result row is matched across the runs by its
non-numeric fields and printed with each side's median and B/A.

    python tools/ab_checkouts.py --a DIR --b DIR [--rounds R] -- benchmarks/bench_small.py \
        --servers dlserve --duration 3

``--a``/``--b``: repository roots (a ``git worktree`` of the older commit, say); the
benchmark's own path is taken relative to each. The same Python runs both.

A probe for developers, not a benchmark of record.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

NUMERIC = ("p50_us", "p99_us", "throughput_rps", "server_cpu_us", "worker_cpu_us")
COUNTS = ("requests", "round")  # differ from run to run: not part of a row's identity


def run_once(root: Path, command: list[str], out: Path) -> list[dict[str, Any]]:
    """The benchmark's result rows, run from ``root``."""
    script, *args = command
    subprocess.run(
        [sys.executable, str(root / script), *args, "--json", str(out)], cwd=root, check=True
    )
    rows: list[dict[str, Any]] = json.loads(out.read_text())["results"]
    return rows


def key_of(row: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(
        (k, v) for k, v in sorted(row.items())
        if k not in NUMERIC and k not in COUNTS and not isinstance(v, float) and v is not None
    )  # fmt: skip


def collect(runs: list[list[dict[str, Any]]]) -> dict[tuple[Any, ...], dict[str, list[float]]]:
    table: dict[tuple[Any, ...], dict[str, list[float]]] = {}
    for rows in runs:
        for row in rows:
            fields = table.setdefault(key_of(row), {})
            for name in NUMERIC:
                if isinstance(row.get(name), int | float):
                    fields.setdefault(name, []).append(float(row[name]))
    return table


def report(a: list[list[dict[str, Any]]], b: list[list[dict[str, Any]]]) -> None:
    table_a, table_b = collect(a), collect(b)
    for key, fields in table_a.items():
        label = " ".join(str(v) for _, v in key)
        for name, values in fields.items():
            other = table_b.get(key, {}).get(name)
            if not other:
                continue
            ma, mb = statistics.median(values), statistics.median(other)
            ratio = mb / ma if ma else float("nan")
            print(f"{label:28s} {name:15s} A {ma:10.1f}  B {mb:10.1f}  B/A {ratio:5.3f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", type=Path, required=True, help="checkout A (the reference)")
    parser.add_argument("--b", type=Path, required=True, help="checkout B")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- benchmark and its options")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the benchmark after --")
    runs_a: list[list[dict[str, Any]]] = []
    runs_b: list[list[dict[str, Any]]] = []
    with tempfile.TemporaryDirectory() as folder:
        for r in range(args.rounds):
            runs_a.append(run_once(args.a.resolve(), command, Path(folder) / f"a{r}.json"))
            runs_b.append(run_once(args.b.resolve(), command, Path(folder) / f"b{r}.json"))
    print(f"medians of {args.rounds} alternating rounds; A = {args.a}, B = {args.b}")
    report(runs_a, runs_b)
    return 0


if __name__ == "__main__":
    sys.exit(main())
