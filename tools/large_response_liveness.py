"""How long other clients wait while the server sends one large response: a client asks
the test model ``sized_output`` for SIZE bytes (HTTP, binary output) and reads them as
fast as they come, while a separate process times HTTP health checks in a tight loop on
a connection of its own; each round prints the transfer's time and the health checks'
p50, p99 and worst.

    python tools/large_response_liveness.py [--sizes-mib 256,1024] [--rounds 3] [ARGS...]

ARGS go to ``dlserve serve``. The first round of a size pays the first touch of the
memory it takes (on a VM the host backs it then): compare the later ones. A probe for
developers, not a benchmark of record; docs/network-edge.md ("Large responses") has its
numbers.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "e2e")]

from test_http_limits import _read_large as fetch  # noqa: E402  (ask, then read at full speed)

from conftest import EXAMPLES, TEST_MODELS, repository_of, run_server  # noqa: E402

PROBE = r"""
import http.client, select, sys, time
connection = http.client.HTTPConnection(sys.argv[1], int(sys.argv[2]), timeout=60)
def check():
    connection.request("GET", "/v2/health/ready")
    connection.getresponse().read()
for _ in range(50):
    check()
print("ready", flush=True)
times = []
while not select.select([sys.stdin], [], [], 0)[0]:
    start = time.perf_counter()
    check()
    times.append(time.perf_counter() - start)
times.sort()
print(f"p50 {times[len(times) // 2] * 1e3:.2f} ms, p99 {times[int(len(times) * .99)] * 1e3:.2f}"
      f" ms, worst {times[-1] * 1e3:.1f} ms over {len(times)}", flush=True)
"""


def _round(port: int, size: int) -> str:
    probe = subprocess.Popen(
        [sys.executable, "-c", PROBE, "127.0.0.1", str(port)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert probe.stdout is not None and probe.stdin is not None
    assert probe.stdout.readline().strip() == "ready"
    start = time.perf_counter()
    received = fetch(port, size)
    elapsed = time.perf_counter() - start
    probe.stdin.write("stop\n")
    probe.stdin.flush()
    health = probe.stdout.readline().strip()
    probe.wait()
    return f"{received >> 20} MiB in {elapsed:.2f} s; health checks meanwhile: {health}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mib", default="256,1024")
    parser.add_argument("--rounds", type=int, default=3)
    args, serve_args = parser.parse_known_args()
    root = Path(tempfile.mkdtemp())
    repository_of(root, EXAMPLES / "identity_fp32", TEST_MODELS / "sized_output")
    with run_server(root, *serve_args) as server:
        fetch(server.http_port, 1 << 20)
        for size in (int(s) << 20 for s in args.sizes_mib.split(",")):
            for _ in range(args.rounds):
                print(_round(server.http_port, size), flush=True)


if __name__ == "__main__":
    main()
