"""What a small request costs between the frontend and the model and back, without a
network frontend, and end to end over HTTP.

``core``: the server's core in this process (``InferenceService`` on uvloop, real
spawned worker processes) serving examples/models add_sub; ``await service.infer(request)``
is timed in a loop with 16-float inputs. ``bls``: the same through ``bls_add_sub``, a model
that passes its request on to add_sub with ``exec()`` (a temporary repository). ``http``:
a real ``dlserve serve`` driven by tritonclient.http, one client, the same request. Each
mode prints p50/p99; core and bls also the CPU per request of the server and of the
(first) worker, and each model's statistics breakdown.

    python tools/core_path.py [--mode core,bls,http] [--requests N]
        [--against SRC --rounds R] [--profile DIR]

``--against SRC`` (another checkout's ``src`` folder, e.g. from ``git archive``) runs each
mode alternately here and there, R rounds each in a fresh process, and prints both sides'
p50s (median of the rounds) and their ratio: timings on a shared machine drift by tens of
percent, so A and B are interleaved. ``--profile DIR``: cProfile dumps of the core loop
(this process) and of the workers (``tools/show_profiles.py DIR``).

A probe for developers, not a benchmark of record.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "models"
ELEMENTS = 16
WARMUP = 300


def _percentiles(samples_ns: list[int]) -> tuple[float, float]:
    ordered = sorted(samples_ns)
    p50 = ordered[len(ordered) // 2] / 1000
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] / 1000
    return p50, p99


BLS_MODEL = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            call = pb_utils.InferenceRequest(
                model_name="add_sub", inputs=request.inputs(),
                requested_output_names=["OUTPUT0", "OUTPUT1"],
            )
            response = call.exec()
            if response.has_error():
                raise pb_utils.TritonModelException(response.error().message())
            responses.append(pb_utils.InferenceResponse(response.output_tensors()))
        return responses
"""


def _bls_repository(root: Path) -> Path:
    """examples' add_sub and ``bls_add_sub``, which passes its inputs on to add_sub (BLS)."""
    shutil.copytree(EXAMPLES / "add_sub", root / "add_sub")
    config = (EXAMPLES / "add_sub" / "config.pbtxt").read_text()
    (root / "bls_add_sub" / "1").mkdir(parents=True)
    (root / "bls_add_sub" / "config.pbtxt").write_text(
        config.replace('name: "add_sub"', 'name: "bls_add_sub"')
    )
    (root / "bls_add_sub" / "1" / "model.py").write_text(BLS_MODEL)
    return root


async def _core_loop(requests: int, profile: str | None, model: str) -> tuple[float, float]:
    from dlserve.server.core.models.repository import Repository
    from dlserve.server.core.service import InferenceService, ServiceOptions

    with tempfile.TemporaryDirectory() as tmp:
        repository = EXAMPLES if model == "add_sub" else _bls_repository(Path(tmp))
        options = ServiceOptions(model_control_mode="explicit", startup_models=[model, "add_sub"])
        service = InferenceService(Repository(repository), options)
        await service.startup()
        return await _timed(service, requests, profile, model)


async def _timed(
    service: Any, requests: int, profile: str | None, model: str
) -> tuple[float, float]:
    from dlserve.types import InferRequest, InputTensor

    a = np.arange(ELEMENTS, dtype=np.float32).tobytes()
    b = np.ones(ELEMENTS, dtype=np.float32).tobytes()

    def request() -> InferRequest:  # as a frontend makes one per call
        inputs = [
            InputTensor("INPUT0", "FP32", (ELEMENTS,), memoryview(a)),
            InputTensor("INPUT1", "FP32", (ELEMENTS,), memoryview(b)),
        ]
        return InferRequest(model, "", "", inputs, [])

    try:
        for _ in range(WARMUP):
            await service.infer(request())
        profiler = None
        if profile:
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        samples: list[int] = []
        clock = time.perf_counter_ns
        pool = service.version(model).pool
        assert pool is not None
        worker_pid = getattr(pool.workers[0], "pid", None)
        cpu = (time.process_time_ns(), _cpu_ns(worker_pid))
        for _ in range(requests):
            start = clock()
            response = await service.infer(request())
            samples.append(clock() - start)
        server_cpu, worker_cpu = time.process_time_ns() - cpu[0], _cpu_ns(worker_pid) - cpu[1]
        print(f"core cpu us per request: server {server_cpu / requests / 1000:.1f}, "
              f"worker {worker_cpu / requests / 1000:.1f}", file=sys.stderr)  # fmt: skip
        if profiler is not None:
            profiler.disable()
            assert profile is not None
            profiler.dump_stats(os.path.join(profile, f"core-{os.getpid()}.prof"))
        out0 = np.frombuffer(response.outputs[0].data or b"", dtype=np.float32)
        assert (out0 == np.arange(ELEMENTS) + 1).all(), out0
        for stats in service.statistics():
            _print_breakdown(stats)
    finally:
        await service.shutdown()
    return _percentiles(samples)


def _cpu_ns(pid: int | None) -> int:
    """User + system CPU time of process ``pid`` (0 when unknown)."""
    if pid is None:
        return 0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])  # utime, stime
    return ticks * 1_000_000_000 // os.sysconf("SC_CLK_TCK")


def _print_breakdown(stats: Any) -> None:
    """Where a request's time went on average, from the model's statistics (the worker's
    timestamps): to stderr, so that ``--json`` output stays one line."""
    s = stats.inference_stats
    count = max(s.success.count, 1)
    parts = {"total": s.success.ns, "queue (send, wake, decode)": s.queue.ns,
             "compute_input": s.compute_input.ns, "compute_infer": s.compute_infer.ns,
             "compute_output (encode, send, wake, read)": s.compute_output.ns}  # fmt: skip
    text = ", ".join(f"{name} {ns / count / 1000:.1f}" for name, ns in parts.items())
    print(f"{stats.name} mean us: {text}", file=sys.stderr)


def run_core(requests: int, profile: str | None, model: str = "add_sub") -> tuple[float, float]:
    from dlserve.server.wiring import asyncio_run

    result: list[tuple[float, float]] = []

    async def main() -> None:
        result.append(await _core_loop(requests, profile, model))

    asyncio_run(main())
    return result[0]


def run_http(requests: int) -> tuple[float, float]:
    import tritonclient.http as httpclient

    read_fd, write_fd = os.pipe()
    command = [sys.executable, "-m", "dlserve", "serve", "--model-repository", str(EXAMPLES),
               "--model-control-mode", "explicit", "--load-model", "add_sub",
               "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0",
               "--ready-fd", str(write_fd)]  # fmt: skip
    server = subprocess.Popen(command, pass_fds=(write_fd,), stdout=subprocess.DEVNULL)
    os.close(write_fd)
    try:
        with os.fdopen(read_fd, "rb") as ready:
            line = ready.readline()
        if not line:
            raise RuntimeError("dlserve exited during startup")
        port = json.loads(line)["http_port"]
        client = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
        inputs = [httpclient.InferInput(n, [ELEMENTS], "FP32") for n in ("INPUT0", "INPUT1")]
        inputs[0].set_data_from_numpy(np.arange(ELEMENTS, dtype=np.float32), binary_data=True)
        inputs[1].set_data_from_numpy(np.ones(ELEMENTS, dtype=np.float32), binary_data=True)
        outputs = [httpclient.InferRequestedOutput(n, binary_data=True)
                   for n in ("OUTPUT0", "OUTPUT1")]  # fmt: skip
        for _ in range(WARMUP):
            client.infer("add_sub", inputs, outputs=outputs)
        samples: list[int] = []
        clock = time.perf_counter_ns
        cpu = (_cpu_ns(server.pid), time.process_time_ns())
        for _ in range(requests):
            start = clock()
            client.infer("add_sub", inputs, outputs=outputs)
            samples.append(clock() - start)
        server_cpu, client_cpu = _cpu_ns(server.pid) - cpu[0], time.process_time_ns() - cpu[1]
        print(f"http cpu us per request: server process {server_cpu / requests / 1000:.1f} "
              f"(its workers not counted), client {client_cpu / requests / 1000:.1f}",
              file=sys.stderr)  # fmt: skip
        client.close()
    finally:
        server.terminate()
        server.wait(30)
    return _percentiles(samples)


def _one(mode: str, requests: int, profile: str | None) -> tuple[float, float]:
    if mode == "bls":
        return run_core(requests, profile, "bls_add_sub")
    return run_core(requests, profile) if mode == "core" else run_http(requests)


def _subprocess_p50(src: str, mode: str, requests: int) -> float:
    env = {**os.environ, "PYTHONPATH": src}
    command = [sys.executable, __file__, "--mode", mode, "--requests", str(requests), "--json"]
    out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
    return float(json.loads(out.strip().splitlines()[-1])[mode][0])


def compare(against: str, modes: list[str], requests: int, rounds: int) -> None:
    here = str(ROOT / "src")
    for mode in modes:
        a: list[float] = []
        b: list[float] = []
        for _ in range(rounds):
            a.append(_subprocess_p50(against, mode, requests))
            b.append(_subprocess_p50(here, mode, requests))
        ma, mb = statistics.median(a), statistics.median(b)
        print(f"{mode:5s} p50 us  against {ma:7.1f} {[round(x) for x in a]}")
        print(f"{mode:5s} p50 us  here    {mb:7.1f} {[round(x) for x in b]}  ({mb / ma:.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="core,http")
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--against", help="another checkout's src folder, for an A/B")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", help="write cProfile dumps (core and workers) here")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    modes = args.mode.split(",")
    if args.against:
        compare(args.against, modes, args.requests, args.rounds)
        return
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
        os.environ["DLSERVE_WORKER_PROFILE"] = os.path.abspath(args.profile)
    results = {mode: _one(mode, args.requests, args.profile) for mode in modes}
    if args.json:
        print(json.dumps(results))
        return
    for mode, (p50, p99) in results.items():
        print(f"{mode:5s} {args.requests} requests  p50 {p50:7.1f} us  p99 {p99:7.1f} us")


if __name__ == "__main__":
    main()
