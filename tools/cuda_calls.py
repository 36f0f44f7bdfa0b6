"""What the CUDA calls on a BLS hop cost (needs a GPU, torch and cuda-python).

Part 1, one process: each call dlserve makes around a GPU tensor passed between models,
timed alone (p50 of many). Part 2, three processes as in a BLS pipeline: a callee runs a
torch kernel into its memory and signals the caller, the caller copies that memory
(opened by IPC handle) into a third process's memory (opened by IPC handle), as the
caller's output into a client's CUDA region; timed against the same copy when the callee
ran nothing just before.

    python tools/cuda_calls.py

A probe for developers, not a benchmark of record.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from dlserve.tensors import cuda_ipc

NBYTES = 3 * 224 * 224 * 4


def timeit(label: str, fn: Callable[[], Any], n: int = 2000) -> None:
    for _ in range(50):
        fn()
    samples = []
    for _ in range(n):
        start = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - start)
    print(f"  {label:<55} p50 {np.percentile(samples, 50) / 1e3:7.1f} us", flush=True)


def one_process() -> None:
    import torch

    rt = cuda_ipc._runtime()
    x = torch.ones(NBYTES // 4, device="cuda")
    y = x * 2
    ptr = y.data_ptr()
    print("one process:")
    timeit("cudaStreamSynchronize(legacy), idle", lambda: rt.cudaStreamSynchronize(0))
    timeit("cuda_ipc.synchronize(0) (with on_device)", lambda: cuda_ipc.synchronize(0))
    timeit("torch x * 2 (launch only)", lambda: x * 2)
    timeit("torch x * 2 + cudaStreamSynchronize", lambda: (x * 2, rt.cudaStreamSynchronize(0)))
    timeit("torch x * 2 + torch.cuda.synchronize", lambda: (x * 2, torch.cuda.synchronize()))
    timeit("cuda_ipc.address_range", lambda: cuda_ipc.address_range(ptr))
    timeit("cudaIpcGetMemHandle", lambda: rt.cudaIpcGetMemHandle(ptr))
    timeit("cuda_ipc.export_handle (sync, range, handle)", lambda: cuda_ipc.export_handle(ptr, 0))
    z = torch.empty_like(x)
    timeit("cuda_ipc.copy 0.6 MB D2D (+ sync)", lambda: cuda_ipc.copy(z.data_ptr(), ptr, NBYTES))
    timeit("cudaGetDevice", lambda: rt.cudaGetDevice())
    callee_steps(x)


def callee_steps(x: Any) -> None:
    """A BLS callee's execute, step by step, as the benchmarks' gpu_times2 runs it."""
    from torch.utils.dlpack import from_dlpack, to_dlpack

    from dlserve import pb_utils as pb_utils
    from dlserve.worker.bls import cuda_peers
    from dlserve.worker.bls import gpu_lending as gpu_bls
    from dlserve.worker.client_regions import ClientRegions

    tensor = pb_utils.Tensor._wrap_gpu(
        "INPUT_0", cuda_peers.gpu_info(x.data_ptr(), [NBYTES // 4], _fp32(), 0), x
    )
    print("a callee's execute, step by step:")
    timeit("pb Tensor.to_dlpack (GPU)", tensor.to_dlpack)
    timeit("torch from_dlpack(pb capsule)", lambda: from_dlpack(tensor.to_dlpack()))
    data = from_dlpack(tensor.to_dlpack())
    timeit("torch data * 2", lambda: data * 2)
    timeit("torch to_dlpack", lambda: to_dlpack(data))
    timeit("pb Tensor.from_dlpack(torch capsule)",
           lambda: pb_utils.Tensor.from_dlpack("OUTPUT_0", to_dlpack(data)))  # fmt: skip

    def body() -> Any:
        d = from_dlpack(tensor.to_dlpack())
        return pb_utils.Tensor.from_dlpack("OUTPUT_0", to_dlpack(d * 2))

    timeit("the whole body (import, kernel, export)", body)
    lender, regions = gpu_bls.GpuLender(), ClientRegions()
    out = body()

    def lend() -> None:
        ref = lender.lend(out, regions)
        assert ref is not None
        lender.give_back([ref.lend])

    timeit("GpuLender.lend + give_back (export with sync)", lend)
    timeit("body + lend", lambda: lender.give_back([lender.lend(body(), regions).lend]))


def _fp32() -> Any:
    from dlserve.tensors import dtypes

    return dtypes.BY_WIRE["FP32"]


def callee(conn: Any) -> None:
    import torch

    x = torch.ones(NBYTES // 4, device="cuda")
    y = torch.empty_like(x)
    handle, _, _ = cuda_ipc.export_handle(y.data_ptr(), 0)
    conn.send(handle)
    while True:
        what = conn.recv()
        if what == "stop":
            return
        if what == "kernel":
            torch.mul(x, 2, out=y)
            cuda_ipc.synchronize(0)
        conn.send("ready")


def client(conn: Any) -> None:
    buf = cuda_ipc.DeviceBuffer(NBYTES, 0)
    handle, _, _ = cuda_ipc.export_handle(buf.ptr, 0)
    conn.send(handle)
    conn.recv()


def three_processes() -> None:
    ctx = mp.get_context("spawn")
    a, a_child = ctx.Pipe()
    c, c_child = ctx.Pipe()
    pa = ctx.Process(target=callee, args=(a_child,))
    pc = ctx.Process(target=client, args=(c_child,))
    pa.start()
    pc.start()
    src = cuda_ipc.open_handle(a.recv(), 0)
    dst = cuda_ipc.open_handle(c.recv(), 0)
    print("three processes (caller copies callee's memory into client's):")
    for what in ("kernel", "nothing"):
        samples = []
        for i in range(1500):
            a.send(what)
            a.recv()
            start = time.perf_counter_ns()
            cuda_ipc.copy(dst, src, NBYTES)
            if i >= 100:
                samples.append(time.perf_counter_ns() - start)
        label = f"copy right after the callee ran {what}"
        print(f"  {label:<55} p50 {np.percentile(samples, 50) / 1e3:7.1f} us", flush=True)
    a.send("stop")
    c.send("stop")
    pa.join()
    pc.join()


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    one_process()
    three_processes()
