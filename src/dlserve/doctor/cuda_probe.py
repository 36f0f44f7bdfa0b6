"""The doctor's CUDA probe, run as a child process: versions, peer access, and on each GPU an
allocation that a second process (this module again, ``open``) maps by its IPC handle and
reads back. Prints one JSON object."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys

from dlserve.tensors import cuda_ipc

PATTERN = bytes(range(256)) * 16


def _open(handle_hex: str, device: int) -> None:
    """The second process: map the handle, read the bytes, print them as hex."""
    ptr = cuda_ipc.open_handle(bytes.fromhex(handle_hex), device)
    out = ctypes.create_string_buffer(len(PATTERN))
    cuda_ipc.copy(ctypes.addressof(out), ptr, len(PATTERN))
    cuda_ipc.close_handle(ptr, device)
    print(out.raw.hex())


def _ipc(device: int) -> str:
    """'' when another process read this GPU's memory through its IPC handle, else why not."""
    try:
        buffer = cuda_ipc.DeviceBuffer(len(PATTERN), device)
        source = ctypes.create_string_buffer(PATTERN, len(PATTERN))
        cuda_ipc.copy(buffer.ptr, ctypes.addressof(source), len(PATTERN))
        handle, _, _ = cuda_ipc.export_handle(buffer.ptr, device)
    except (cuda_ipc.CudaError, cuda_ipc.CudaUnavailable) as exc:
        return str(exc)
    done = subprocess.run(
        [sys.executable, "-m", "dlserve.doctor.cuda_probe", "open", handle.hex(), str(device)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if done.returncode != 0:
        return (done.stderr.strip().splitlines() or ["the second process failed"])[-1]
    if bytes.fromhex(done.stdout.strip()) != PATTERN:
        return "the second process read other bytes"
    return ""


def main() -> None:
    if sys.argv[1:2] == ["open"]:
        _open(sys.argv[2], int(sys.argv[3]))
        return
    runtime = cuda_ipc._runtime()
    count = cuda_ipc.device_count()
    peer = [
        (a, b, bool(runtime.cudaDeviceCanAccessPeer(a, b)[1]))
        for a in range(count)
        for b in range(count)
        if a != b
    ]
    print(
        json.dumps(
            {
                "driver": _version(runtime.cudaDriverGetVersion()[1]),
                "runtime": _version(runtime.cudaRuntimeGetVersion()[1]),
                "ipc": [_ipc(device) for device in range(count)],
                "peer": peer,
            }
        )
    )


def _version(number: int) -> str:
    return f"{number // 1000}.{number % 1000 // 10}"


if __name__ == "__main__":
    main()
