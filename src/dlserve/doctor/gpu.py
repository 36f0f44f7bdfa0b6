"""The GPUs this process sees (NVML), the driver's and CUDA's versions, CUDA IPC between two
processes on each GPU, peer access between GPUs, and MPS.

NVML is read through ctypes (``libnvidia-ml.so.1`` comes with the driver); the CUDA checks
need cuda-python (``pip install 'dlserve[gpu]'``) and run in child processes, so this
process never holds a CUDA context.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Final

from dlserve.doctor.report import Result, Row

IPC_TIMEOUT_S: Final = 60.0
GPU_FIX: Final = (
    "install the NVIDIA driver and container toolkit; docker: --gpus all; "
    "Kubernetes: resources.limits nvidia.com/gpu (deploy/kubernetes/overlays/gpu); "
    "check CUDA_VISIBLE_DEVICES"
)


@dataclass(frozen=True, slots=True)
class Gpus:
    uuids: list[str]
    names: list[str]
    driver: str
    error: str = ""  # why NVML could not be read


def nvml() -> Gpus:
    """The GPUs NVML lists, without creating a CUDA context."""
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return Gpus([], [], "", "no NVIDIA driver (libnvidia-ml.so.1 not found)")
    if lib.nvmlInit_v2() != 0:
        return Gpus([], [], "", "NVML did not initialize")
    try:
        return _devices(lib)
    finally:
        lib.nvmlShutdown()


def _devices(lib: Any) -> Gpus:
    buffer = ctypes.create_string_buffer(96)
    lib.nvmlSystemGetDriverVersion(buffer, 96)
    driver = buffer.value.decode()
    count = ctypes.c_uint()
    lib.nvmlDeviceGetCount_v2(ctypes.byref(count))
    uuids, names = [], []
    for i in range(count.value):
        handle = ctypes.c_void_p()
        lib.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(handle))
        lib.nvmlDeviceGetUUID(handle, buffer, 96)
        uuids.append(buffer.value.decode())
        lib.nvmlDeviceGetName(handle, buffer, 96)
        names.append(buffer.value.decode())
    return Gpus(uuids, names, driver)


def visible(gpus: Gpus, need_gpu: bool) -> Row:
    cuda_visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if gpus.uuids:
        names = ", ".join(sorted(set(gpus.names)))
        found = f"{len(gpus.uuids)} ({names}), driver {gpus.driver}"
        if cuda_visible is not None:
            found += f"; CUDA_VISIBLE_DEVICES={cuda_visible!r}"
        return Row("GPUs", "ok", found)
    result: Result = "fail" if need_gpu else "skip"
    fix = GPU_FIX if need_gpu else "none needed: models run on the CPU (--gpu to require GPUs)"
    return Row("GPUs", result, gpus.error or "NVML lists no GPU", fix)


def cuda_checks(gpus: Gpus, need_gpu: bool) -> list[Row]:
    """CUDA's versions, IPC on each GPU, peer access: run in a child process."""
    if not gpus.uuids:
        return [Row("CUDA IPC", "skip", "no GPU")]
    try:
        done = subprocess.run(
            [sys.executable, "-m", "dlserve.doctor.cuda_probe"],
            capture_output=True,
            text=True,
            timeout=IPC_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return [Row("CUDA IPC", "fail", f"the probe took over {IPC_TIMEOUT_S:.0f} s", GPU_FIX)]
    if done.returncode != 0 or not done.stdout.strip():
        reason = (done.stderr.strip().splitlines() or ["the probe failed"])[-1]
        result: Result = "fail" if need_gpu else "warn"
        return [Row("CUDA", result, reason, "pip install 'dlserve[gpu]' (cuda-python)")]
    found = json.loads(done.stdout)
    rows = [Row("CUDA versions", "ok", f"driver API {found['driver']}, runtime {found['runtime']}")]
    for device, error in enumerate(found["ipc"]):
        rows.append(
            Row(
                f"CUDA IPC, GPU {device}",
                "fail" if error else "ok",
                error or "another process mapped and read this GPU's memory",
                "CUDA IPC needs both processes in one IPC and PID namespace on one "
                "host (docker: --ipc=host); MIG instances and some vGPUs refuse it"
                if error
                else "",
            )
        )
    if len(found["ipc"]) > 1:
        pairs = found["peer"]
        missing = [f"{a}->{b}" for a, b, ok in pairs if not ok]
        rows.append(
            Row(
                "GPU peer access",
                "warn" if missing else "ok",
                f"no peer access {', '.join(missing)}" if missing else "every pair",
                "copies between those GPUs go through host memory: keep a client's "
                "regions on its model instance's GPU"
                if missing
                else "",
            )
        )
    return rows


def mps() -> Row:
    control = shutil.which("nvidia-cuda-mps-control")
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
    running = os.path.exists(os.path.join(pipe, "control"))
    if running:
        return Row("MPS", "ok", f"a daemon runs ({pipe}): workers use it without --mps")
    if control:
        return Row("MPS", "ok", f"available ({control}): dlserve serve --mps starts one")
    return Row(
        "MPS",
        "skip",
        "nvidia-cuda-mps-control not installed",
        "only for --mps (several GPU models on one GPU): install the driver's utilities",
    )
