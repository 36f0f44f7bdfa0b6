"""How many GPUs this server may use, found without creating a CUDA context."""

from __future__ import annotations

import functools
import os


@functools.cache
def gpu_count() -> int:
    """GPUs visible to this process: NVML if installed, else the driver's /proc entries."""
    total = _nvml_count()
    if total is None:
        try:
            total = len(os.listdir("/proc/driver/nvidia/gpus"))
        except OSError:
            total = 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return total
    entries = [v for v in visible.split(",") if v.strip() and not v.strip().startswith("-")]
    return min(total, len(entries))


def _nvml_count() -> int | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return None
