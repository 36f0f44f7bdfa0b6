"""The HTTP fuzzers, run longer than the suite runs them and with random seeds.

Runs the hypothesis tests of the HTTP/1.1 request reader
(``tests/server/transport/test_http1_fuzz.py``) and of the HTTP frontend's decoding, the
KServe JSON request, the binary tensor extension and Content-Encoding
(``tests/server/frontends/test_http_fuzz.py``), each test with ``--examples`` examples. A
failure prints hypothesis's smallest failing input: add it to that file's
``test_regressions``.

    python tools/fuzz_http.py [--examples N] [--target reader|decoding|all] [--seed S]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGETS = {
    "reader": ["tests/server/transport/test_http1_fuzz.py"],
    "decoding": ["tests/server/frontends/test_http_fuzz.py"],
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=100_000, help="per test")
    parser.add_argument("--target", choices=[*TARGETS, "all"], default="all")
    parser.add_argument("--seed", type=int, help="hypothesis's seed (default: random)")
    args = parser.parse_args()
    files = [f for name, fs in TARGETS.items() if args.target in (name, "all") for f in fs]
    env = {**os.environ, "DLSERVE_FUZZ_EXAMPLES": str(args.examples)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *files]
    if args.seed is not None:
        command.append(f"--hypothesis-seed={args.seed}")
    return subprocess.call(command, cwd=ROOT, env=env)


if __name__ == "__main__":
    sys.exit(main())
