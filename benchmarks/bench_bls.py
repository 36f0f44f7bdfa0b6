"""A BLS pipeline against the same pipeline in one model, on the GPU (needs a GPU).

dlserve serves ``benchmarks/models_bls``: ``bls_gpu_pipeline`` receives the input through
CUDA shared memory, calls ``gpu_times2`` then ``gpu_plus1`` (BLS; the tensors stay on the
GPU and pass between models by CUDA IPC handle) and returns the result into CUDA shared
memory; ``gpu_pipeline`` computes x * 2 + 1 in one model. One client (unmodified
tritonclient.grpc, regions registered once), fp32 [1,3,224,224] (0.6 MB) and
[128,3,224,224] (77 MB), p50 and p99 of each.

    python benchmarks/bench_bls.py [--duration S] [--sizes 0.6MB,77MB] [--busy-poll-us US] [--mps]
        [--json PATH]

Target (issue 6): the BLS pipeline's p50 at most 1.5x the single model's. Reference,
Triton 2.51 on the same kind of machine, tritonclient gRPC, 1 client: BLS 13.6 ms against
2.9 ms for the single model at 77 MB, 4.1 ms against 1.3 ms at 0.6 MB. A benchmark, not a
test: it checks one answer per model and size, nothing else.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _triton  # a sibling module, not a package

MODELS = Path(__file__).resolve().parent / "models_bls"
SIZES = {"0.6MB": [1, 3, 224, 224], "77MB": [128, 3, 224, 224]}
TRITON_MS = {"0.6MB": (4.1, 1.3), "77MB": (13.6, 2.9)}  # (BLS p50, single model p50)


def measure(url: str, model: str, shape: list[int], seconds: float, warmup: float) -> list[float]:
    """Latencies (s) of back-to-back requests; input and output in CUDA shared memory."""
    import tritonclient.grpc as grpcclient
    import tritonclient.utils.cuda_shared_memory as cudashm

    client = grpcclient.InferenceServerClient(url)
    nbytes = int(np.prod(shape)) * 4
    tag = f"bench_bls_{os.getpid()}"
    regions = [cudashm.create_shared_memory_region(f"{tag}_{n}", nbytes, 0) for n in "io"]
    try:
        for name, region in zip(("in", "out"), regions, strict=True):
            raw = cudashm.get_raw_handle(region)
            client.register_cuda_shared_memory(f"{tag}_{name}", raw, 0, nbytes)
        data = np.random.default_rng(7).standard_normal(shape).astype(np.float32)
        cudashm.set_shared_memory_region(regions[0], [data])
        tensor = grpcclient.InferInput("INPUT_0", shape, "FP32")
        tensor.set_shared_memory(f"{tag}_in", nbytes)
        output = grpcclient.InferRequestedOutput("OUTPUT_0")
        output.set_shared_memory(f"{tag}_out", nbytes)
        client.infer(model, [tensor], outputs=[output])
        got = cudashm.get_contents_as_numpy(regions[1], np.float32, shape)
        np.testing.assert_allclose(got, data * 2 + 1, rtol=1e-6)
        deadline = time.perf_counter() + warmup
        while time.perf_counter() < deadline:
            client.infer(model, [tensor], outputs=[output])
        latencies = []
        deadline = time.perf_counter() + seconds
        while (now := time.perf_counter()) < deadline:
            client.infer(model, [tensor], outputs=[output])
            latencies.append(time.perf_counter() - now)
        return latencies
    finally:
        client.unregister_cuda_shared_memory()
        for region in regions:
            cudashm.destroy_shared_memory_region(region)
        client.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per measurement")
    parser.add_argument("--warmup", type=float, default=1.0, help="warm-up seconds")
    parser.add_argument("--sizes", default="0.6MB,77MB")
    parser.add_argument("--busy-poll-us", type=int, default=0, help="dlserve's --busy-poll-us")
    parser.add_argument("--mps", action="store_true", help="dlserve's --mps")
    parser.add_argument("--dlserve-args", default="", help="more `dlserve serve` options")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    rows: list[dict[str, Any]] = []
    with _triton.run_dlserve(
        MODELS,
        *_triton.free_ports(3),
        "--busy-poll-us",
        str(args.busy_poll_us),
        *(["--mps"] if args.mps else []),
        *args.dlserve_args.split(),
    ) as server:
        for size in args.sizes.split(","):
            for model in ("gpu_pipeline", "bls_gpu_pipeline"):
                micros = np.array(
                    measure(server.grpc_url, model, SIZES[size], args.duration, args.warmup)
                ) * 1e6  # fmt: skip
                row = {"size": size, "model": model, "requests": int(micros.size),
                       "p50_us": float(np.percentile(micros, 50)),
                       "p99_us": float(np.percentile(micros, 99))}  # fmt: skip
                rows.append(row)
                print(f"# {row}", file=sys.stderr, flush=True)
    print(f"{'size':<6} {'model':<18} {'requests':>9} {'p50 us':>9} {'p99 us':>9}")
    for row in rows:
        print(f"{row['size']:<6} {row['model']:<18} {row['requests']:>9} {row['p50_us']:>9.0f} "
              f"{row['p99_us']:>9.0f}")  # fmt: skip
    for size in args.sizes.split(","):
        single, bls = (r["p50_us"] for r in rows if r["size"] == size)
        triton_bls, triton_single = TRITON_MS[size]
        print(f"{size}: BLS / single p50 = {bls / single:.2f} (target <= 1.5; Triton 2.51: "
              f"{triton_bls / triton_single:.1f})")  # fmt: skip
    if args.json is not None:
        document = {
            "benchmark": "bench_bls",
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
            "reference": {"server": "Triton 2.51 (issue 6's numbers, ms)", "numbers": TRITON_MS},
            "results": rows,
        }
        args.json.write_text(json.dumps(document, indent=2) + "\n")


if __name__ == "__main__":
    main()
