"""Long runs of the gRPC edge's fuzz targets (``tests/grpc_fuzz.py``): the ModelInferRequest
walk, the gRPC length-prefixed message reader, the server<->worker codec's decoder.

    python tools/fuzz_grpc.py infer-request --examples 200000 [--seed N]
    python tools/fuzz_grpc.py all --examples 50000

The suite runs each for a few thousand derandomized examples; this runs as many as asked,
from a random seed (printed, so a failure can be run again with ``--seed``), and prints
the smallest failing input hypothesis finds. A failure found here becomes a regression
test beside the suite's run.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

from hypothesis import HealthCheck, given, seed, settings  # noqa: E402

from grpc_fuzz import TARGETS  # noqa: E402


def run(name: str, examples: int, chosen: int) -> None:
    strategy, check = TARGETS[name]
    if name == "ipc-codec":
        tracemalloc.start()

    @seed(chosen)
    @settings(
        max_examples=examples, database=None, deadline=None,
        suppress_health_check=list(HealthCheck),
    )  # fmt: skip
    @given(strategy)
    def target(case: Any) -> None:
        check(case)

    started = time.monotonic()
    try:
        target()
    finally:
        if name == "ipc-codec":
            tracemalloc.stop()
    print(f"{name}: {examples} examples passed in {time.monotonic() - started:.1f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target", choices=[*sorted(TARGETS), "all"])
    parser.add_argument("--examples", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=None, help="default: a random one")
    args = parser.parse_args()
    chosen = args.seed if args.seed is not None else random.randrange(2**32)
    print(f"seed {chosen}")
    for name in sorted(TARGETS) if args.target == "all" else [args.target]:
        run(name, args.examples, chosen)
    return 0


if __name__ == "__main__":
    sys.exit(main())
