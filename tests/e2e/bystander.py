"""Another client's view of a server while a test misbehaves on its own connections.

A :class:`Bystander` is a process of its own (so the test's attack, in the test process,
does not take its time): it holds one HTTP/1.1 keep-alive connection and one gRPC channel,
both opened before the attack, and measures what a well-behaved client would see:

- ``watching()``: while the ``with`` block runs, HTTP ``/v2/health/ready``, gRPC
  ``ServerReady`` and a small ``identity_fp32`` inference over gRPC, in turn, as fast as
  they are answered;
- ``alone(seconds)``: the same for a while with nothing else going on.

``seen.check(alone)`` asserts the liveness bound of the network edge: every health check
answered within 100 ms, and the inference p99 within twice its p99 alone. Where an attack
is known not to meet a bound yet on a small machine, ``p99_or_known_gap`` and
``bounds_or_known_gap`` report the numbers as an expected failure, after asserting what
must always hold (no error, no health check later than a second: the server never stops
serving others).

The attacker's own CPU is not the server's: on a machine of two cores a test process that
spins takes a core from the server and its worker, and the bystander's p99 grows fivefold
with no request sent. So attack code that loops (a flood) runs in a process of its own at
the lowest priority (``os.nice(19)``), as an attacker on another host would; one that
writes once and holds (a bomb, idle connections) needs no such care.

With ``BYSTANDER_LOG=PATH`` set, each check appends one JSON line to PATH: the test, the
inference p99 against alone, and the slowest health checks (how a run on another machine
reports its numbers for the tests that pass).

Run as a script it is the child: commands on stdin (``watch``, then ``stop``),
one JSON line of latencies (seconds) on stdout for each.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

HEALTH_BOUND_S = 0.100
FROZEN_S = 1.0  # a health check this late: the server stopped serving others
P99_FACTOR = 2.0
MODEL = "identity_fp32"  # in the bundled examples and the repositories tests build from them


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


@dataclass
class Seen:
    """What the bystander saw while watching: the latency of each call, in seconds."""

    http_health: list[float] = field(default_factory=list)
    grpc_health: list[float] = field(default_factory=list)
    infer: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def report(self, alone: Seen) -> None:
        """One JSON line of the numbers to ``BYSTANDER_LOG``, where it is set."""
        path = os.environ.get("BYSTANDER_LOG")
        if not path or not (self.infer and alone.infer):
            return
        line = {
            "test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0],
            "p99_ms": round(p99(self.infer) * 1e3, 3),
            "alone_p99_ms": round(p99(alone.infer) * 1e3, 3),
            "health_max_ms": [
                round(max(h, default=0.0) * 1e3, 2) for h in (self.http_health, self.grpc_health)
            ],
        }
        with open(path, "a") as log:
            print(json.dumps(line), file=log)

    def check(self, alone: Seen) -> None:
        """Both bounds: health within 100 ms, inference p99 within 2x alone."""
        self.check_health()
        self.check_p99(alone)

    def check_health(self, bound_s: float = HEALTH_BOUND_S) -> None:
        assert not self.errors, self.errors
        assert self.http_health and self.grpc_health and self.infer, "nothing was measured"
        worst = max(self.http_health), max(self.grpc_health)
        assert max(worst) <= bound_s, f"health answered in {worst} s (HTTP, gRPC)"

    def check_p99(self, alone: Seen) -> None:
        self.report(alone)
        ours, theirs = p99(self.infer), p99(alone.infer)
        assert ours <= P99_FACTOR * theirs, (
            f"inference p99 {ours * 1e3:.2f} ms against {theirs * 1e3:.2f} ms alone"
        )

    def p99_or_known_gap(self, alone: Seen, gap: str) -> None:
        """The p99 bound where an attack is known not to meet it yet: the test is reported
        as an expected failure with the numbers and ``gap`` (why), after its other checks
        passed; a run that meets the bound passes."""
        try:
            self.check_p99(alone)
        except AssertionError as exc:
            pytest.xfail(f"{exc}: {gap}")

    def bounds_or_known_gap(self, alone: Seen, gap: str) -> None:
        """Both bounds where an attack is known not to meet them yet: no errors and no
        health check later than ``FROZEN_S`` always; past the bounds, an expected failure
        with the numbers and ``gap``."""
        self.check_health(FROZEN_S)
        try:
            self.check(alone)
        except AssertionError as exc:
            pytest.xfail(f"{exc}: {gap}")


class Bystander:
    """The parent's handle on the bystander process (a context manager)."""

    def __init__(self, http_url: str, grpc_url: str, model: str = MODEL) -> None:
        self.process = subprocess.Popen(
            [sys.executable, __file__, http_url, grpc_url, model],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )  # fmt: skip
        assert self._reply(deadline_s=60) == "ready"

    def __enter__(self) -> Bystander:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                pipe.close()

    def alone(self, seconds: float = 2.0) -> Seen:
        """What the bystander sees for ``seconds`` while nothing else happens."""
        with self.watching() as seen:
            threading.Event().wait(seconds)
        return seen

    @contextlib.contextmanager
    def watching(self) -> Iterator[Seen]:
        """Measure while the block runs; the ``Seen`` is filled when the block ends."""
        seen = Seen()
        self._send("watch")
        assert self._reply(deadline_s=60) == "watching"
        try:
            yield seen
        finally:
            self._send("stop")
            result = self._reply(deadline_s=120)
            seen.http_health, seen.grpc_health = result["http_health"], result["grpc_health"]
            seen.infer, seen.errors = result["infer"], result["errors"]

    def _send(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line.encode() + b"\n")
        self.process.stdin.flush()

    def _reply(self, deadline_s: float) -> Any:
        assert self.process.stdout is not None
        readable, _, _ = select.select([self.process.stdout], [], [], deadline_s)
        assert readable, "the bystander did not answer in time"
        line = self.process.stdout.readline()
        assert line, f"the bystander exited (code {self.process.wait()})"
        return json.loads(line)


# -- the child ---------------------------------------------------------------------------
def _child(http_url: str, grpc_url: str, model: str) -> None:
    import http.client

    import numpy as np
    import tritonclient.grpc as grpcclient

    host, port = http_url.rsplit(":", 1)
    http = http.client.HTTPConnection(host, int(port), timeout=30)
    grpc = grpcclient.InferenceServerClient(grpc_url)
    data = np.arange(16, dtype=np.float32).reshape(1, 16)
    tensor = grpcclient.InferInput("INPUT0", list(data.shape), "FP32")
    tensor.set_data_from_numpy(data)

    def http_health() -> None:
        http.request("GET", "/v2/health/ready")
        response = http.getresponse()
        response.read()
        assert response.status == 200, response.status

    def grpc_health() -> None:
        assert grpc.is_server_ready()

    def infer() -> None:
        result = grpc.infer(model, [tensor])
        assert np.array_equal(result.as_numpy("OUTPUT0"), data)

    def timed(call: Any, into: list[float], errors: list[str]) -> None:
        start = time.perf_counter()
        try:
            call()
        except Exception as exc:
            errors.append(f"{call.__name__}: {exc!r}")
        into.append(time.perf_counter() - start)

    for _ in range(20):  # warm: connections open, the instance has served
        http_health(), grpc_health(), infer()
    out = sys.stdout
    print(json.dumps("ready"), file=out, flush=True)
    for line in sys.stdin:
        command = line.split()
        if command[0] == "watch":
            seen: dict[str, list[Any]] = {
                k: [] for k in ("http_health", "grpc_health", "infer", "errors")
            }
            print(json.dumps("watching"), file=out, flush=True)
            while not select.select([sys.stdin], [], [], 0)[0]:
                timed(http_health, seen["http_health"], seen["errors"])
                timed(grpc_health, seen["grpc_health"], seen["errors"])
                timed(infer, seen["infer"], seen["errors"])
            sys.stdin.readline()  # "stop"
            print(json.dumps(seen), file=out, flush=True)


if __name__ == "__main__":
    _child(*sys.argv[1:4])
