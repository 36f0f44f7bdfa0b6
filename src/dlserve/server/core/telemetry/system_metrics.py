"""Triton's CPU and GPU metrics, read when the metrics endpoint is scraped.

CPU (Linux ``/proc``): ``nv_cpu_utilization`` over the time since the previous scrape (the
first scrape: since the server started), ``nv_cpu_memory_total_bytes`` and
``nv_cpu_memory_used_bytes`` (total less available). GPUs (NVML, ``libnvidia-ml.so.1``
through ctypes, when the driver is there), one sample per GPU labelled ``gpu_uuid``:
``nv_gpu_utilization``, ``nv_gpu_memory_total_bytes``, ``nv_gpu_memory_used_bytes``,
``nv_gpu_power_usage``, ``nv_gpu_power_limit`` and ``nv_energy_consumption`` (joules
since the server started). A value the device does not report is left out.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

_NVML_SUCCESS = 0


class _Utilization(ctypes.Structure):
    _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]


class _Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong),
                ("used", ctypes.c_ulonglong)]  # fmt: skip


def cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat."""
    with open("/proc/stat", "rb") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # guest time is already counted in user and nice
    return total - idle, total


def memory() -> tuple[int, int]:
    """(total, used) bytes of RAM, from /proc/meminfo (used: total less available)."""
    found: dict[bytes, int] = {}
    with open("/proc/meminfo", "rb") as f:
        for line in f:
            key, _, rest = line.partition(b":")
            if key in (b"MemTotal", b"MemAvailable"):
                found[key] = int(rest.split()[0]) * 1024
    total = found.get(b"MemTotal", 0)
    return total, total - found.get(b"MemAvailable", total)


class _Nvml:
    """The few NVML calls the metrics need; ``devices`` is empty without a driver."""

    def __init__(self) -> None:
        self.devices: list[tuple[str, Any]] = []  # (uuid, handle)
        self._energy_start: dict[str, int] = {}
        try:
            self.lib: Any = ctypes.CDLL("libnvidia-ml.so.1")
            if self.lib.nvmlInit_v2() != _NVML_SUCCESS:
                return
        except (OSError, AttributeError):
            return
        count = ctypes.c_uint()
        if self.lib.nvmlDeviceGetCount_v2(ctypes.byref(count)) != _NVML_SUCCESS:
            return
        for index in _visible(count.value):
            handle = ctypes.c_void_p()
            if self.lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)):
                continue
            text = ctypes.create_string_buffer(96)
            if self.lib.nvmlDeviceGetUUID(handle, text, 96) == _NVML_SUCCESS:
                self.devices.append((text.value.decode(), handle))
        wanted = _visible_uuids()
        if wanted:
            self.devices = [d for d in self.devices if any(d[0].startswith(w) for w in wanted)]
        for gpu, handle in self.devices:
            energy = self._read(self.lib.nvmlDeviceGetTotalEnergyConsumption, handle,
                                ctypes.c_ulonglong)  # fmt: skip
            if energy is not None:
                self._energy_start[gpu] = energy

    @staticmethod
    def _read(call: Callable[..., int], handle: Any, kind: Any) -> Any:
        value = kind()
        return value.value if call(handle, ctypes.byref(value)) == _NVML_SUCCESS else None

    def samples(self, uuid: str, handle: Any) -> dict[str, float]:
        lib, out = self.lib, {}
        use = _Utilization()
        if lib.nvmlDeviceGetUtilizationRates(handle, ctypes.byref(use)) == _NVML_SUCCESS:
            out["nv_gpu_utilization"] = use.gpu / 100.0
        mem = _Memory()
        if lib.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(mem)) == _NVML_SUCCESS:
            out["nv_gpu_memory_total_bytes"] = float(mem.total)
            out["nv_gpu_memory_used_bytes"] = float(mem.used)
        power = self._read(lib.nvmlDeviceGetPowerUsage, handle, ctypes.c_uint)
        if power is not None:
            out["nv_gpu_power_usage"] = power / 1000.0  # milliwatts
        limit = self._read(lib.nvmlDeviceGetEnforcedPowerLimit, handle, ctypes.c_uint)
        if limit is not None:
            out["nv_gpu_power_limit"] = limit / 1000.0
        energy = self._read(lib.nvmlDeviceGetTotalEnergyConsumption, handle, ctypes.c_ulonglong)
        if energy is not None and uuid in self._energy_start:
            out["nv_energy_consumption"] = (energy - self._energy_start[uuid]) / 1000.0  # mJ
        return out


def _visible(count: int) -> list[int]:
    """The NVML indices CUDA_VISIBLE_DEVICES lets this server use (all when unset)."""
    entries = [e.strip() for e in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")]
    if "CUDA_VISIBLE_DEVICES" not in os.environ:
        return list(range(count))
    if any(not e.isdigit() for e in entries if e):  # UUIDs: matched by _visible_uuids
        return list(range(count))
    return [int(e) for e in entries if e and int(e) < count]


def _visible_uuids() -> list[str]:
    entries = [e.strip() for e in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")]
    return [e for e in entries if e.startswith(("GPU-", "MIG-"))]


_GPU_FAMILIES = (
    ("nv_gpu_utilization", "GPU utilization rate [0.0 - 1.0)", "gauge"),
    ("nv_gpu_memory_total_bytes", "GPU total memory, in bytes", "gauge"),
    ("nv_gpu_memory_used_bytes", "GPU used memory, in bytes", "gauge"),
    ("nv_gpu_power_usage", "GPU power usage in watts", "gauge"),
    ("nv_gpu_power_limit", "GPU power management limit in watts", "gauge"),
    ("nv_energy_consumption", "GPU energy consumption in joules since the server started",
     "counter"),
)  # fmt: skip


class SystemCollector(Collector):
    """CPU and GPU metrics with Triton's names; NVML is opened at the first scrape."""

    def __init__(self, cpu: bool = True, gpu: bool = True) -> None:
        self._cpu_on = cpu and os.path.exists("/proc/stat")  # --allow-cpu-metrics
        self._gpu_on = gpu  # --allow-gpu-metrics
        self._last_cpu = cpu_times() if self._cpu_on else (0, 0)
        self._nvml: _Nvml | None = None

    def collect(self) -> Iterator[Metric]:
        if self._cpu_on:
            yield from self._cpu()
        if not self._gpu_on:
            return
        if self._nvml is None:
            self._nvml = _Nvml()
        yield from self._gpus(self._nvml)

    def _cpu(self) -> Iterator[Metric]:
        busy, total = cpu_times()
        last_busy, last_total = self._last_cpu
        self._last_cpu = (busy, total)
        share = (busy - last_busy) / (total - last_total) if total > last_total else 0.0
        ram_total, ram_used = memory()
        for name, text, value in (
            ("nv_cpu_utilization", "CPU utilization rate [0.0 - 1.0]", share),
            ("nv_cpu_memory_total_bytes", "CPU total memory (RAM), in bytes", ram_total),
            ("nv_cpu_memory_used_bytes", "CPU used memory (RAM), in bytes", ram_used),
        ):
            metric = Metric(name, text, "gauge")
            metric.add_sample(name, {}, float(value))
            yield metric

    @staticmethod
    def _gpus(nvml: _Nvml) -> Iterator[Metric]:
        if not nvml.devices:
            return
        per_gpu = [(uuid, nvml.samples(uuid, handle)) for uuid, handle in nvml.devices]
        for name, text, kind in _GPU_FAMILIES:
            metric = Metric(name, text, kind)
            for uuid, values in per_gpu:
                if name in values:
                    metric.add_sample(name, {"gpu_uuid": uuid}, values[name])
            if metric.samples:
                yield metric
