"""The floor of ``bench_shm.py``'s request on this machine, next to Triton's p50 for it.

What no server can avoid for a 4 MB request through system shared memory, measured
apart:

- ``call``: the unmodified client's ``infer()`` with its input and output in regions (the
  benchmark's own call), answered at once by a server that does nothing else: dlserve's
  gRPC transport in another process, its response a canned one of the right shape (no core,
  no worker, no region touched);
- ``copy``: the one copy the request needs (the model returns its input, and the output
  must land in the client's output region): 4 MB between two shared-memory mappings, in a
  process with dlserve's workers' glibc tuning (non-temporal stores from 1 MiB), in a loop.

Then Triton serves ``bench_shm.py``'s request itself (``identity_4mb``), as in that
benchmark, and the floor's share of Triton's p50 is printed (``bench_shm.py``'s target is
0.3). The parts alternate with Triton's runs (``--rounds``), since the machine drifts.

    python tools/shm_floor.py [--rounds 2] [--requests 3000]

A probe for developers, not a benchmark of record (Linux).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "src"))
import _triton  # noqa: E402  (benchmarks/_triton.py and tools/shm_parts.py: modules)
import shm_parts  # noqa: E402

ELEMENTS = 1024 * 1024  # bench_shm.py's 4 MB of FP32

COPY = """
import mmap, statistics, time
import numpy as np
size = {size}
source, target = mmap.mmap(-1, size), mmap.mmap(-1, size)
np.frombuffer(source, np.uint8)[:] = 1
np.frombuffer(target, np.uint8)[:] = 2
src, dst = memoryview(source), memoryview(target)
took = []
for _ in range({count}):
    start = time.perf_counter_ns()
    dst[:] = src
    took.append(time.perf_counter_ns() - start)
print(statistics.median(took[20:]) / 1e3)
"""


def canned_server(ports: Any) -> None:
    """dlserve's gRPC transport answering every ModelInfer at once, as a server answers a
    request whose output went into a region: the output's name, type and shape, no data."""
    import uvloop
    from tritonclient.grpc import service_pb2 as pb

    from dlserve.server.transport.grpc.calls import Method
    from dlserve.server.transport.grpc.listener import GrpcServer

    output = pb.ModelInferResponse.InferOutputTensor(
        name="OUTPUT0", datatype="FP32", shape=[ELEMENTS]
    )

    async def infer(request: Any, context: Any) -> Any:
        return pb.ModelInferResponse(model_name=request.model_name, model_version="1",
                                     id=request.id, outputs=[output])  # fmt: skip

    method = Method(infer, deserialize=pb.ModelInferRequest.FromString,
                    serialize=pb.ModelInferResponse.SerializeToString)  # fmt: skip
    loop = uvloop.new_event_loop()
    server = GrpcServer({"/inference.GRPCInferenceService/ModelInfer": method}, "127.0.0.1", 0)
    ports.put(loop.run_until_complete(server.start()))
    loop.run_forever()


def call_floor(requests: int) -> float:
    import tritonclient.grpc as grpcclient

    ports: Any = multiprocessing.Queue()
    server = multiprocessing.Process(target=canned_server, args=(ports,), daemon=True)
    server.start()
    try:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{ports.get(timeout=60)}")
        tensor = grpcclient.InferInput("INPUT0", [ELEMENTS], "FP32")
        tensor.set_shared_memory("floor_in", ELEMENTS * 4)
        output = grpcclient.InferRequestedOutput("OUTPUT0")
        output.set_shared_memory("floor_out", ELEMENTS * 4)
        took = shm_parts.p50_us(
            lambda: client.infer(shm_parts.MODEL, [tensor], outputs=[output]), requests
        )
        client.close()
        return took
    finally:
        server.terminate()
        server.join()


def copy_floor() -> float:
    from dlserve.tensors.heap import streaming_copies

    code = COPY.format(size=ELEMENTS * 4, count=400)
    done = subprocess.run([sys.executable, "-c", code], env=streaming_copies(os.environ),
                          capture_output=True, text=True, check=True)  # fmt: skip
    return float(done.stdout)


def triton_p50(requests: int) -> float:
    import tritonclient.grpc as grpcclient

    with _triton.run_triton(shm_parts.MODELS, *_triton.free_ports(3)) as server:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        took = shm_parts.shm_part(client, ELEMENTS, requests)
        client.close()
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=3000)
    args = parser.parse_args()
    print(
        f"{'round':>5} {'call us':>8} {'copy us':>8} {'floor us':>9} {'Triton us':>10} {'share':>6}"
    )
    for round_ in range(args.rounds):
        call, copy = call_floor(args.requests), copy_floor()
        triton = triton_p50(args.requests)
        floor = call + copy
        print(f"{round_:>5} {call:>8.0f} {copy:>8.0f} {floor:>9.0f} {triton:>10.0f} "
              f"{floor / triton:>6.3f}")  # fmt: skip
    print("share: the floor over Triton's p50 for the same request (bench_shm's target: 0.3)")


if __name__ == "__main__":
    main()
