"""The SDK against hand-written tritonclient code, with a GPU torch tensor as the input.

dlserve serves ``examples/models/double`` (a GPU instance: OUTPUT_0 = 2 * INPUT_0, one
1x3x224x224 FP32 image, 588 KiB) and is driven by one client, one request in flight, the
output coming back to the client's host memory each time:

- ``sdk``: ``dlserve.client.Client.infer("double", {"INPUT_0": gpu_tensor})`` (the SDK puts
  the input, and the output of fixed size, in its pooled regions);
- ``hand``: tritonclient with a CUDA shared-memory region registered once; each request
  copies the tensor into it (``set_shared_memory_by_cuda_array``) and infers; the output
  comes back in the response;
- ``hand_shm``: the same with a second region, registered once, for the output, read back
  with ``get_contents_as_numpy``;
- ``per_request``: the client many CUDA shared-memory examples show: create, copy,
  register, infer, unregister and destroy a region for every request.

    .venv/bin/python benchmarks/bench_sdk.py [--requests N | --duration S] [--json PATH]

Prints p50 / p99 (microseconds) and the two ratios it is judged by: sdk p50 over the
faster hand-written p50 (target <= 1.10) and per_request p50 over sdk p50 (target >= 10).
Needs a CUDA device, torch with CUDA and cuda-python. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import platform
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _triton  # a sibling module, not a package
from bench_shm import measure  # the same measuring loop (warm-up, then by count or time)

MODEL = "double"
SHAPE = (1, 3, 224, 224)
MODELS = Path(__file__).resolve().parent.parent / "examples" / "models"


@dataclass(frozen=True)
class Row:
    path: str
    requests: int
    p50_us: float
    p99_us: float


@contextlib.contextmanager
def sdk(url: str, image: Any) -> Iterator[Callable[[], Any]]:
    from dlserve.client import Client

    with Client(url) as client:
        yield lambda: client.infer(MODEL, {"INPUT_0": image})["OUTPUT_0"]


@contextlib.contextmanager
def hand(url: str, image: Any, output_region: bool = False) -> Iterator[Callable[[], Any]]:
    import tritonclient.grpc as grpcclient

    from dlserve.client import cuda_shared_memory as cudashm

    nbytes = image.numel() * image.element_size()
    device = image.device.index
    client = grpcclient.InferenceServerClient(url)
    names = ["bench_hand_in", "bench_hand_out"] if output_region else ["bench_hand_in"]
    regions = [cudashm.create_shared_memory_region(n, nbytes, device) for n in names]
    for name, region in zip(names, regions, strict=True):
        client.register_cuda_shared_memory(name, cudashm.get_raw_handle(region), device, nbytes)
    tensor = grpcclient.InferInput("INPUT_0", list(SHAPE), "FP32")
    tensor.set_shared_memory("bench_hand_in", nbytes)
    output = grpcclient.InferRequestedOutput("OUTPUT_0")
    if output_region:
        output.set_shared_memory("bench_hand_out", nbytes)

    def infer() -> Any:
        cudashm.set_shared_memory_by_cuda_array(regions[0], image.data_ptr(), nbytes)
        result = client.infer(MODEL, [tensor], outputs=[output])
        if output_region:
            return cudashm.get_contents_as_numpy(regions[1], np.float32, SHAPE)
        return result.as_numpy("OUTPUT_0")

    try:
        yield infer
    finally:
        client.unregister_cuda_shared_memory()
        for region in regions:
            cudashm.destroy_shared_memory_region(region)
        client.close()


@contextlib.contextmanager
def per_request(url: str, image: Any) -> Iterator[Callable[[], Any]]:
    import tritonclient.grpc as grpcclient

    from dlserve.client import cuda_shared_memory as cudashm

    nbytes = image.numel() * image.element_size()
    device = image.device.index
    client = grpcclient.InferenceServerClient(url)

    def infer() -> Any:  # every step, every request
        region = cudashm.create_shared_memory_region("bench_per_request", nbytes, device)
        try:
            cudashm.set_shared_memory_by_cuda_array(region, image.data_ptr(), nbytes)
            raw = cudashm.get_raw_handle(region)
            client.register_cuda_shared_memory("bench_per_request", raw, device, nbytes)
            tensor = grpcclient.InferInput("INPUT_0", list(SHAPE), "FP32")
            tensor.set_shared_memory("bench_per_request", nbytes)
            answer = client.infer(MODEL, [tensor]).as_numpy("OUTPUT_0")
            client.unregister_cuda_shared_memory("bench_per_request")
            return answer
        finally:
            cudashm.destroy_shared_memory_region(region)

    try:
        yield infer
    finally:
        client.close()


PATHS = {
    "sdk": sdk,
    "hand": hand,
    "hand_shm": functools.partial(hand, output_region=True),
    "per_request": per_request,
}


def run(args: argparse.Namespace) -> list[Row]:
    import torch

    image = torch.randn(SHAPE, device="cuda:0")
    expected = (image * 2).cpu().numpy()
    rows = []
    with _triton.run_dlserve(MODELS, *_triton.free_ports(3)) as server:
        for path in args.paths:
            with PATHS[path](server.grpc_url, image) as infer:
                np.testing.assert_allclose(infer(), expected)
                latencies_us = np.array(measure(infer, args)) / 1000.0
            rows.append(Row(path, int(latencies_us.size),
                            float(np.percentile(latencies_us, 50)),
                            float(np.percentile(latencies_us, 99))))  # fmt: skip
            print(f"#   {rows[-1]}", file=sys.stderr)
    return rows


def ratios(rows: list[Row]) -> dict[str, float]:
    p50 = {row.path: row.p50_us for row in rows}
    found = {}
    hands = [p50[path] for path in ("hand", "hand_shm") if path in p50]
    if "sdk" in p50 and hands:  # against the faster hand-written client
        found["sdk_over_hand"] = p50["sdk"] / min(hands)
    if "sdk" in p50 and "per_request" in p50:
        found["per_request_over_sdk"] = p50["per_request"] / p50["sdk"]
    return found


def report(rows: list[Row]) -> None:
    print(f"{'path':<12} {'requests':>9} {'p50 us':>10} {'p99 us':>10}")
    for row in rows:
        print(f"{row.path:<12} {row.requests:>9} {row.p50_us:>10.0f} {row.p99_us:>10.0f}")
    found = ratios(rows)
    if "sdk_over_hand" in found:
        verdict = "ok" if found["sdk_over_hand"] <= 1.10 else "ABOVE TARGET"
        print(f"sdk p50 / best hand p50 = {found['sdk_over_hand']:.3f} (target <= 1.10: {verdict})")
    if "per_request_over_sdk" in found:
        verdict = "ok" if found["per_request_over_sdk"] >= 10 else "BELOW TARGET"
        print(f"per_request p50 / sdk p50 = {found['per_request_over_sdk']:.1f} "
              f"(target >= 10: {verdict})")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--paths", default="sdk,hand,hand_shm,per_request",
                        type=lambda t: [p for p in t.split(",") if p])  # fmt: skip
    parser.add_argument("--requests", type=int, help="requests per measurement")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per measurement")
    parser.add_argument("--warmup", type=float, default=1.0, help="warm-up seconds")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    if set(args.paths) - PATHS.keys():
        parser.error("unknown path")
    rows = run(args)
    report(rows)
    if args.json is not None:
        document = {
            "benchmark": "bench_sdk",
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
            "settings": {"model": MODEL, "shape": SHAPE, "protocol": "grpc", "clients": 1},
            "results": [asdict(row) for row in rows],
            "ratios": ratios(rows),
        }
        args.json.write_text(json.dumps(document, indent=2) + "\n")


if __name__ == "__main__":
    main()
