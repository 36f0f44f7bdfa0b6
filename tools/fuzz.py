"""Run the suite's fuzzers longer than the suite does, from a random seed:
``tools/fuzz.py NAME --examples N`` runs each hypothesis property of NAME with N
examples (``tests/fuzzing.py`` says how the suite runs them).

    .venv/bin/python tools/fuzz.py h2 --examples 100000
    .venv/bin/python tools/fuzz.py grpc -k ipc-codec --seed 1234
    .venv/bin/python tools/fuzz.py all --examples 20000

Fuzzers:
- ``h2``: the HTTP/2 frame reader and the HPACK decoder;
- ``http1``: the HTTP/1.1 request head and body reader;
- ``http``: the KServe JSON request, the binary tensor extension and Content-Encoding;
- ``grpc``: the ModelInferRequest walk (whole and as it arrives), the gRPC
  length-prefixed message reader and the server<->worker codec (``tests/grpc_fuzz.py``).

The seed is printed first: ``--seed`` runs the same examples again. A failure prints the
smallest example hypothesis found; make it a regression test beside the property.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FUZZERS = {
    "h2": "tests/server/transport/test_h2_fuzz.py",
    "http1": "tests/server/transport/test_http1_fuzz.py",
    "http": "tests/server/frontends/test_http_fuzz.py",
    "grpc": "tests/server/test_edge_fuzz.py",
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("name", choices=[*FUZZERS, "all"])
    parser.add_argument("--examples", type=int, default=20_000, help="per property")
    parser.add_argument("--seed", type=int, default=None, help="default: a random one")
    parser.add_argument("-k", dest="only", default=None, help="pytest's -k: some properties")
    args = parser.parse_args()
    chosen = args.seed if args.seed is not None else random.randrange(2**32)
    print(f"seed {chosen}", flush=True)
    env = {**os.environ, "DLSERVE_FUZZ_EXAMPLES": str(args.examples), "DLSERVE_FUZZ_RANDOM": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    files = list(FUZZERS.values()) if args.name == "all" else [FUZZERS[args.name]]
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
               f"--hypothesis-seed={chosen}", *files]  # fmt: skip
    if args.only:
        command += ["-k", args.only]
    return subprocess.call(command, cwd=ROOT, env=env)


if __name__ == "__main__":
    sys.exit(main())
