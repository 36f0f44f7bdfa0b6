"""What a request through system shared memory costs, in parts, on dlserve and on Triton.

Each server in turn serves ``benchmarks/models`` (``identity_4mb``: output = input, any
length) and is driven by unmodified tritonclient.grpc, one client, one request in flight:

- ``raw16``: 16 floats in the request and back in the response (the fixed cost of a call);
- ``shm16``: 16 floats through registered system shared-memory regions (the fixed cost of
  a shared-memory call);
- ``shm4MB``: 4 MB through the regions, as ``bench_shm.py`` sends them.

    python tools/shm_parts.py [--servers dlserve,triton,dlserve,triton]
        [--requests N] [--variant NAME=OPTIONS ...]

``--variant busy="--busy-poll-us 2000"`` names a dlserve started with more options; the
name can then be listed in ``--servers`` (its ratios are taken against the last Triton).

Prints each part's p50 per server start, and dlserve's over Triton's for the 4 MB request
and for its fixed part: the share of ``bench_shm.py``'s target (0.3) that the fixed cost
of a call alone already takes. A probe for developers, not a benchmark of record.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import _triton  # benchmarks/_triton.py: a module, not a package

MODELS = Path(__file__).resolve().parents[1] / "benchmarks" / "models"
MODEL = "identity_4mb"
WARMUP = 300


def p50_us(infer: Callable[[], Any], requests: int) -> float:
    for _ in range(WARMUP):
        infer()
    samples = []
    for _ in range(requests):
        start = time.perf_counter_ns()
        infer()
        samples.append(time.perf_counter_ns() - start)
    return float(np.percentile(samples, 50)) / 1000


def raw_part(client: Any, elements: int, requests: int) -> float:
    import tritonclient.grpc as grpcclient

    tensor = grpcclient.InferInput("INPUT0", [elements], "FP32")
    tensor.set_data_from_numpy(np.ones(elements, np.float32))
    output = grpcclient.InferRequestedOutput("OUTPUT0")
    return p50_us(lambda: client.infer(MODEL, [tensor], outputs=[output]), requests)


def shm_part(client: Any, elements: int, requests: int) -> float:
    import tritonclient.grpc as grpcclient
    import tritonclient.utils.shared_memory as shm

    nbytes = elements * 4
    tag = f"shm_parts_{os.getpid()}_{elements}"
    handles = [shm.create_shared_memory_region(f"{tag}{x}", f"/{tag}{x}", nbytes) for x in "io"]
    try:
        for x in "io":
            client.register_system_shared_memory(f"{tag}{x}", f"/{tag}{x}", nbytes)
        data = np.random.default_rng(1).standard_normal(elements).astype(np.float32)
        shm.set_shared_memory_region(handles[0], [data])
        tensor = grpcclient.InferInput("INPUT0", [elements], "FP32")
        tensor.set_shared_memory(f"{tag}i", nbytes)
        output = grpcclient.InferRequestedOutput("OUTPUT0")
        output.set_shared_memory(f"{tag}o", nbytes)
        took = p50_us(lambda: client.infer(MODEL, [tensor], outputs=[output]), requests)
        answer = shm.get_contents_as_numpy(handles[1], np.float32, [elements])
        np.testing.assert_array_equal(answer, data)
        return took
    finally:
        client.unregister_system_shared_memory()
        for handle in handles:
            shm.destroy_shared_memory_region(handle)


def measure(name: str, requests: int, variants: dict[str, list[str]]) -> dict[str, float]:
    import tritonclient.grpc as grpcclient

    if name == "triton":
        server_cm = _triton.run_triton(MODELS, *_triton.free_ports(3))
    else:
        server_cm = _triton.run_dlserve(MODELS, *_triton.free_ports(3), *variants.get(name, []))
    with server_cm as server:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        parts = {
            "raw16": raw_part(client, 16, requests),
            "shm16": shm_part(client, 16, requests),
            "shm4MB": shm_part(client, 1024 * 1024, requests),
        }
        client.close()
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", default="dlserve,triton,dlserve,triton")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=OPTIONS",
        help="a dlserve started with more options, listed in --servers as NAME",
    )
    args = parser.parse_args()
    variants = {n: o.split() for n, _, o in (v.partition("=") for v in args.variant)}
    last: dict[str, dict[str, float]] = {}
    print(f"{'server':<8} {'raw16 us':>9} {'shm16 us':>9} {'shm4MB us':>10}")
    for name in args.servers.split(","):
        parts = last[name] = measure(name, args.requests, variants)
        print(f"{name:<8} {parts['raw16']:>9.0f} {parts['shm16']:>9.0f} {parts['shm4MB']:>10.0f}")
        if name != "triton" and "triton" in last:
            ours, theirs = parts, last["triton"]
            whole, fixed = ours["shm4MB"] / theirs["shm4MB"], ours["shm16"] / theirs["shm4MB"]
            print(
                f"  over Triton's 4 MB p50: {name}'s 4 MB request {whole:.3f}, its 16-float"
                f" shared-memory request alone {fixed:.3f} (bench_shm's target: 0.3)"
            )


if __name__ == "__main__":
    main()
