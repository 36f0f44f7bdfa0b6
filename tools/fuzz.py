"""Run a fuzzer of the test suite longer than the suite does: ``tools/fuzz.py NAME
--examples N`` runs its hypothesis properties with N examples each (derandomized, as in
the suite; ``--seed`` varies them).

    PYTHONPATH=$PWD/src .venv/bin/python tools/fuzz.py h2 --examples 100000

Fuzzers: ``h2`` (tests/server/transport/test_h2_fuzz.py: the HTTP/2 frame reader and the
HPACK decoder). A failure prints the smallest example hypothesis found; make it a
regression test.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FUZZERS = {"h2": "tests/server/transport/test_h2_fuzz.py"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("name", choices=sorted(FUZZERS))
    parser.add_argument("--examples", type=int, default=20_000, help="per property")
    parser.add_argument("--seed", type=int, default=None, help="random, not derandomized")
    args = parser.parse_args()
    env = {**os.environ, "DLSERVE_FUZZ_EXAMPLES": str(args.examples)}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", FUZZERS[args.name]]
    if args.seed is not None:
        env["DLSERVE_FUZZ_RANDOM"] = "1"
        command.append(f"--hypothesis-seed={args.seed}")
    return subprocess.call(command, cwd=ROOT, env=env)


if __name__ == "__main__":
    sys.exit(main())
