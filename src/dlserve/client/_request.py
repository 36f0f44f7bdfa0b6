"""What Client and AsyncClient share: the URL, the pools, and turning ``infer``'s inputs into
tritonclient's InferInputs (through the pools) and its result into tensors."""

from __future__ import annotations

import functools
import glob
import ipaddress
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import urlsplit

import numpy as np
import numpy.typing as npt

from dlserve.client import _cuda
from dlserve.client import cuda_shared_memory as cudashm
from dlserve.client import shared_memory as shm
from dlserve.client._outputs import ModelOutputs, OutputLayout, PlacedOutput, read_placed
from dlserve.client._pool import KEY_PREFIX, RegionPool, Slot, aligned, pid_namespace
from dlserve.client._tensors import DeviceArray, DeviceInput, HostInput, describe
from dlserve.tensors import dtypes

log = logging.getLogger("dlserve.client")

PID_HEADER: Final = "dlserve-client-pid"  # lets the server tell which local process owns a region
SHM_THRESHOLD: Final = 64 * 1024  # smaller host inputs travel in the request itself
OutputSpec = Sequence[str] | Mapping[str, Any] | None


@dataclass(frozen=True, slots=True)
class Target:
    protocol: str  # "grpc" | "http"
    url: str  # as tritonclient takes it
    local: bool  # on this host: shared memory can work
    ssl: bool = False


def parse_url(url: str) -> Target:
    """``host:port`` or ``grpc://host:port`` (gRPC), ``http://`` / ``https://`` (HTTP),
    ``unix:///path`` or ``unix:/path`` (gRPC on a Unix socket)."""
    if url.startswith("unix:"):
        path = url.removeprefix("unix:").removeprefix("//")
        return Target("grpc", f"unix:{path}", True)
    parts = urlsplit(url if "://" in url else f"grpc://{url}")
    scheme = parts.scheme.lower()
    if scheme not in ("grpc", "http", "https"):
        raise ValueError(f"unsupported URL scheme in {url!r}: use grpc://, http://, unix://")
    protocol = "grpc" if scheme == "grpc" else "http"
    host = parts.hostname or "localhost"
    port = parts.port or (8001 if protocol == "grpc" else 8000)
    shown = f"[{host}]" if ":" in host else host
    return Target(protocol, f"{shown}:{port}", _is_local(host), scheme == "https")


def _is_local(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def device_of(spec: Any) -> int | None:
    """An output's device: None/"cpu" for the host, an int, "cuda", "cuda:N", torch.device."""
    if spec is None:
        return None
    if isinstance(spec, int):
        return spec
    text = str(spec)
    if text == "cpu":
        return None
    if text == "cuda":
        return 0
    if text.startswith("cuda:") and text[5:].isdigit():
        return int(text[5:])
    raise ValueError(f"unknown output device {spec!r}: use 'cpu', 'cuda', 'cuda:N' or an int")


def sweep_stale_objects() -> None:
    """Remove the system objects of SDK processes that died without cleaning up (SIGKILL):
    their names hold their PID namespace and pid. The server has reclaimed their
    registrations already. Objects of another namespace are left alone (their pids cannot
    be checked from here)."""
    prefix = f"{KEY_PREFIX}{pid_namespace()}_"
    for path in glob.glob(f"/dev/shm/{prefix}*"):
        pid = os.path.basename(path).removeprefix(prefix).split("_", 1)[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            try:
                if os.stat(path).st_uid == os.getuid():
                    os.unlink(path)
            except OSError:
                pass


@dataclass(slots=True)
class Pools:
    """A client's pools: one of system memory, one per GPU (made on first use, once even
    when threads ask at the same time)."""

    max_free: int
    pid: int = field(default_factory=os.getpid)
    host: RegionPool | None = None
    gpus: dict[int, RegionPool] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def host_pool(self) -> RegionPool:
        with self.lock:
            if self.host is None:
                destroy = shm.destroy_shared_memory_region
                self.host = RegionPool(-1, _create_host, destroy, self.max_free)
            return self.host

    def gpu_pool(self, device: int) -> RegionPool:
        with self.lock:
            pool = self.gpus.get(device)
            if pool is None:
                create = functools.partial(_create_cuda, device=device)
                destroy = cudashm.destroy_shared_memory_region
                pool = self.gpus[device] = RegionPool(device, create, destroy, self.max_free)
            return pool

    def all(self) -> list[RegionPool]:
        with self.lock:
            return ([self.host] if self.host is not None else []) + list(self.gpus.values())


def _create_cuda(name: str, size: int, device: int) -> cudashm.CudaSharedMemoryRegion:
    return cudashm.create_shared_memory_region(name, size, device)


def _create_host(name: str, size: int) -> shm.SharedMemoryRegion:
    return shm.create_shared_memory_region(name, f"/{name}", size, create_only=True)


def refused(exc: Exception) -> bool:
    """Whether a register call failed because the server will not take shared memory
    from this client (disabled, not local, no GPU): UNIMPLEMENTED, as dlserve and Triton
    answer it."""
    status = getattr(exc, "status", None)
    return callable(status) and str(status()) in ("StatusCode.UNIMPLEMENTED", "501")


def register_args(slot: Slot) -> tuple[str, tuple[Any, ...]]:
    """The register call for a slot: the method's name and its arguments."""
    if slot.device < 0:
        return "register_system_shared_memory", (slot.name, f"/{slot.name}", slot.size)
    raw = cudashm.get_raw_handle(slot.region)
    return "register_cuda_shared_memory", (slot.name, raw, slot.device, slot.size)


def unregister_name(slot: Slot) -> str:
    if slot.device < 0:
        return "unregister_system_shared_memory"
    return "unregister_cuda_shared_memory"


@dataclass(slots=True)
class Prepared:
    inputs: list[Any]  # tritonclient InferInputs
    outputs: list[Any] | None  # tritonclient InferRequestedOutputs; None: all
    devices: dict[str, int | None]  # where each requested output goes
    taken: list[tuple[RegionPool, Slot]] = field(default_factory=list)
    keepalive: list[object] = field(default_factory=list)
    placed: dict[str, PlacedOutput] = field(default_factory=dict)  # outputs into regions

    def fresh(self) -> list[Slot]:
        return [slot for _, slot in self.taken if not slot.registered]


@dataclass(slots=True)
class Planner:
    lib: Any  # tritonclient.grpc or tritonclient.http
    target: Target
    pools: Pools
    use_shm: bool
    threshold: int

    def stop_using_shm(self, why: Exception) -> None:
        if self.use_shm:
            self.use_shm = False
            log.warning(
                "the server refuses client shared memory (%s): tensors travel in the "
                "requests from now on", why,
            )  # fmt: skip

    def prepare(
        self, inputs: Mapping[str, Any], outputs: OutputSpec, known: ModelOutputs | None = None
    ) -> Prepared:
        """``known``: the model's outputs; those of fixed size may be written into regions.
        With ``outputs`` None (every output, on the host), every output is asked for by
        name when one of them is big enough to be worth a region: it then comes back
        through shared memory instead of in the response."""
        layouts = known.fixed if known is not None else {}
        if (
            outputs is None
            and known is not None
            and self.use_shm
            and known.largest >= self.threshold
        ):
            outputs = list(known.names)
        described = [describe(name, value) for name, value in inputs.items()]
        prepared = Prepared([], *self._outputs(outputs))
        try:
            self._place(described, prepared, self._placeable(prepared, layouts))
        except BaseException:
            self.give_back(prepared)  # nothing registered yet: fresh regions are destroyed
            raise
        return prepared

    def _outputs(self, outputs: OutputSpec) -> tuple[list[Any] | None, dict[str, int | None]]:
        if outputs is None:
            return None, {}
        items = outputs.items() if isinstance(outputs, Mapping) else ((n, None) for n in outputs)
        devices = {name: device_of(spec) for name, spec in items}
        kwargs = {"binary_data": True} if self.target.protocol == "http" else {}
        return [self.lib.InferRequestedOutput(n, **kwargs) for n in devices], devices

    def _placeable(
        self, prepared: Prepared, layouts: Mapping[str, OutputLayout]
    ) -> list[PlacedOutput]:
        """Requested outputs of fixed size: on a GPU, or big enough on the host."""
        placed: list[PlacedOutput] = []
        for name, device in prepared.devices.items():
            layout = layouts.get(name)
            if layout is None or not self.use_shm:
                continue
            if device is not None or layout.nbytes >= self.threshold:
                placed.append(PlacedOutput(layout, -1 if device is None else device))
        return placed

    def _place(
        self, described: list[HostInput | DeviceInput], prepared: Prepared,
        outputs: list[PlacedOutput],
    ) -> None:  # fmt: skip
        by_pool: dict[int, list[HostInput | DeviceInput | PlacedOutput]] = {}
        for tensor in described:
            if isinstance(tensor, DeviceInput):
                prepared.keepalive.append(tensor.keepalive)
                if not self.use_shm:
                    tensor = _to_host(tensor)
            if isinstance(tensor, DeviceInput):
                by_pool.setdefault(tensor.device, []).append(tensor)
            elif self.use_shm and len(tensor.data) >= self.threshold:
                by_pool.setdefault(-1, []).append(tensor)
            else:
                prepared.inputs.append(self._inline(tensor))
        for output in outputs:
            by_pool.setdefault(output.device, []).append(output)
        requested = {o.name(): o for o in prepared.outputs or []}
        for device, items in by_pool.items():
            pool = self.pools.host_pool() if device < 0 else self.pools.gpu_pool(device)
            offsets, end = [], 0
            for item in items:
                offsets.append(aligned(end))
                end = offsets[-1] + _nbytes(item)
            slot = pool.take(end)
            prepared.taken.append((pool, slot))
            for item, offset in zip(items, offsets, strict=True):
                if isinstance(item, PlacedOutput):
                    item.slot, item.offset = slot, offset
                    prepared.placed[item.layout.name] = item
                    requested[item.layout.name].set_shared_memory(slot.name, _nbytes(item), offset)
                    continue
                _write(slot, item, offset)
                infer_input = self.lib.InferInput(item.name, item.shape, item.dtype.wire)
                infer_input.set_shared_memory(slot.name, _nbytes(item), offset=offset)
                prepared.inputs.append(infer_input)

    def _inline(self, tensor: HostInput) -> Any:
        infer_input = self.lib.InferInput(tensor.name, tensor.shape, tensor.dtype.wire)
        array = tensor.array
        if tensor.dtype.wire == "BF16":
            array = _bf16_for_tritonclient(array)
        infer_input.set_data_from_numpy(array)
        return infer_input

    def timeout(self, seconds: float | None) -> dict[str, Any]:
        """The infer call's keyword for a client-side deadline (gRPC has one)."""
        return {"client_timeout": seconds} if self.target.protocol == "grpc" else {}

    def results(self, result: Any, prepared: Prepared) -> dict[str, Any]:
        names = list(prepared.devices) or _output_names(result, self.target.protocol)
        out: dict[str, Any] = {}
        for name in names:
            placed = prepared.placed.get(name)
            if placed is not None:
                out[name] = read_placed(result, self.target.protocol, placed)
                continue
            array = result.as_numpy(name)
            device = prepared.devices.get(name)
            out[name] = array if device is None else _to_device(name, array, device)
        return out

    def give_back(self, prepared: Prepared) -> list[tuple[RegionPool, Slot]]:
        """The call's regions are idle again; those to drop (unregister and destroy)."""
        drop = [(pool, gone) for pool, slot in prepared.taken for gone in pool.give(slot)]
        prepared.taken.clear()
        prepared.keepalive.clear()
        return drop


def _bf16_for_tritonclient(storage: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """BF16 held as uint16, as tritonclient takes it: ml_dtypes.bfloat16 (since r26.06),
    float32 that it truncates before."""
    try:
        import ml_dtypes
    except ImportError:
        return (storage.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return storage.view(ml_dtypes.bfloat16)


def _nbytes(item: HostInput | DeviceInput | PlacedOutput) -> int:
    if isinstance(item, PlacedOutput):
        return item.layout.nbytes
    return item.nbytes if isinstance(item, DeviceInput) else len(item.data)


def _write(slot: Slot, tensor: HostInput | DeviceInput, offset: int) -> None:
    if isinstance(tensor, DeviceInput):
        cudashm.set_shared_memory_by_cuda_array(slot.region, tensor.ptr, tensor.nbytes, offset)
    else:
        slot.region.buf[offset : offset + len(tensor.data)] = tensor.data


def _to_host(tensor: DeviceInput) -> HostInput:
    """A host copy of a GPU input, for a server that cannot open CUDA IPC handles."""
    host = np.empty(tensor.nbytes, dtype=np.uint8)
    _cuda.copy(host.ctypes.data, tensor.ptr, tensor.nbytes, tensor.device)
    array = host.view(tensor.dtype.numpy_storage).reshape(tensor.shape)
    return HostInput(tensor.name, tensor.dtype, tensor.shape, array, host.data)


def _to_device(name: str, array: npt.NDArray[Any], device: int) -> DeviceArray:
    dtype = dtypes.from_numpy(array.dtype)
    if dtype is None or dtype.is_bytes:
        raise ValueError(f"output '{name}' of type {array.dtype} cannot be placed on a GPU")
    return DeviceArray.from_host(array, dtype, device)


def _output_names(result: Any, protocol: str) -> list[str]:
    response = result.get_response()
    if protocol == "grpc":
        return [output.name for output in response.outputs]
    return [output["name"] for output in response.get("outputs", [])]
