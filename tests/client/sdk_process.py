"""A client process for the SDK tests.

usage: python sdk_process.py URL MODE [CALLS]

- ``loop``: CALLS calls to add_sub with this process's own data, each result checked;
  prints one JSON line {"pid", "ok", "regions"} (the regions' names) and exits cleanly.
- ``exit``: one call, prints the names and keys of its regions, exits without close():
  the interpreter's exit must clean up.
- ``hang``: one call, prints the names and keys, then waits to be killed.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from dlserve.client import Client


def main() -> None:
    url, mode = sys.argv[1], sys.argv[2]
    calls = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    rng = np.random.default_rng(os.getpid())
    client = Client(url)
    ok = 0
    for _ in range(calls):
        a = rng.standard_normal(50_000).astype(np.float32)  # > 64 KiB: through a region
        b = rng.standard_normal(50_000).astype(np.float32)
        out = client.infer("add_sub", {"INPUT0": a, "INPUT1": b})
        ok += bool(np.array_equal(out["OUTPUT0"], a + b) and np.array_equal(out["OUTPUT1"], a - b))
    names = [slot.name for pool in client._pools.all() for slot in pool._all]
    print(json.dumps({"pid": os.getpid(), "ok": ok, "regions": names}), flush=True)
    if mode == "loop":
        client.close()
    elif mode == "hang":
        sys.stdin.read()
    # "exit": no close(); the finalizer runs at interpreter exit


if __name__ == "__main__":
    main()
