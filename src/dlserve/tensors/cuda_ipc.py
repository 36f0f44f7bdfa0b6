"""The CUDA calls dlserve makes: IPC handles, copies, pinned host memory, device binding.

Everything goes through cuda-python's ``cuda.bindings`` (the ``gpu`` extra), imported on
first use: a server or worker that never meets GPU memory never loads CUDA and never
creates a context. Errors come out as :class:`CudaError` with CUDA's own error name; the
callers (core, workers) turn them into messages a user can act on.

Streams: dlserve's copies run on CUDA's legacy default stream (``LEGACY_STREAM``), which
orders them after work that a producer queued on the legacy stream (or on any blocking
stream), and they are synchronized before the bytes are handed on.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable
from typing import Any, Final

HANDLE_SIZE: Final = 64  # sizeof(cudaIpcMemHandle_t)
LEGACY_STREAM: Final = 1  # cudaStreamLegacy, as DLPack's __dlpack__(stream=1) names it


class CudaError(RuntimeError):
    """A CUDA call failed; ``name`` is CUDA's error name (cudaErrorInvalidValue ...)."""

    def __init__(self, call: str, name: str, text: str) -> None:
        super().__init__(f"{call} failed: {name} ({text})")
        self.call = call
        self.name = name
        self.text = text


class CudaUnavailable(RuntimeError):
    """cuda-python is not installed, or there is no CUDA device."""


@functools.cache
def _runtime() -> Any:
    try:
        from cuda.bindings import runtime
    except ImportError:
        try:
            from cuda import cudart as runtime  # cuda-python before 12.6
        except ImportError:
            raise CudaUnavailable(
                "CUDA support needs cuda-python (pip install 'dlserve[gpu]')"
            ) from None
    return runtime


@functools.cache
def _driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError:
        from cuda import cuda as driver  # cuda-python before 12.6
    return driver


def available() -> bool:
    """Whether cuda-python is installed and sees at least one device."""
    try:
        return device_count() > 0
    except (CudaUnavailable, CudaError):
        return False


def _check(call: str, result: Any) -> Any:
    """Unpack a cuda.bindings result tuple, raising CudaError when its status is not 0."""
    err, *values = result
    if int(err) != 0:
        runtime = _runtime()
        if isinstance(err, runtime.cudaError_t):
            name = runtime.cudaGetErrorName(err)[1]
            text = runtime.cudaGetErrorString(err)[1]
        else:
            driver = _driver()
            name = driver.cuGetErrorName(err)[1]
            text = driver.cuGetErrorString(err)[1]
        raise CudaError(call, _text(name), _text(text))
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def _status(call: str, result: Any) -> None:
    """``_check`` for a call that returns only its status (the per-call paths: nothing is
    built when it is 0)."""
    if int(result[0]) != 0:
        _check(call, result)


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# --- devices ----------------------------------------------------------------------------


def device_count() -> int:
    try:
        return int(_check("cudaGetDeviceCount", _runtime().cudaGetDeviceCount()))
    except CudaError as exc:
        if exc.name in ("cudaErrorNoDevice", "cudaErrorInsufficientDriver"):
            return 0
        raise


def set_device(device: int) -> None:
    """Make ``device`` (its primary context) current for this thread."""
    _check("cudaSetDevice", _runtime().cudaSetDevice(device))


def current_device() -> int:
    return int(_check("cudaGetDevice", _runtime().cudaGetDevice()))


def device_uuid(device: int) -> str:
    """The device's UUID as nvidia-smi prints it: GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx."""
    driver = _driver()
    _check("cuInit", driver.cuInit(0))
    handle = _check("cuDeviceGet", driver.cuDeviceGet(device))
    raw = bytes(_check("cuDeviceGetUuid", driver.cuDeviceGetUuid(handle)).bytes)
    text = raw.hex()
    return f"GPU-{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:32]}"


@functools.cache
def _sole_device() -> bool:
    """Whether this process sees exactly one device (fixed for its life): then device 0 is
    always the current one, and nothing need be asked or switched."""
    return device_count() == 1


def _current(device: int) -> bool:
    """Whether ``device`` is current without asking: the process sees only device 0."""
    return device == 0 and _sole_device()


class on_device:
    """Run a block with ``device`` current, then restore the thread's previous device."""

    __slots__ = ("device", "previous")

    def __init__(self, device: int) -> None:
        self.device = device
        self.previous = -1

    def __enter__(self) -> None:
        if _current(self.device):  # the device call saved on the BLS path
            return
        self.previous = current_device()
        if self.previous != self.device:
            set_device(self.device)

    def __exit__(self, *exc: object) -> None:
        if self.previous not in (-1, self.device):
            set_device(self.previous)


# --- IPC handles ------------------------------------------------------------------------


def _handle(raw: bytes) -> Any:
    if len(raw) != HANDLE_SIZE:
        raise ValueError(f"a cudaIpcMemHandle_t is {HANDLE_SIZE} bytes, not {len(raw)}")
    handle = _runtime().cudaIpcMemHandle_t()
    # cuda-bindings 13 dropped the 'reserved' field: write the struct through its address.
    ctypes.memmove(handle.getPtr(), raw, HANDLE_SIZE)
    return handle


def open_handle(raw: bytes, device: int, peer_access: bool = True) -> int:
    """Map another process's allocation into this one, in ``device``'s context.

    The pointer is the start of the exporter's allocation. An open is dear (far more than
    a request's own work): callers cache the pointer and close it once (:func:`close_handle`).
    Without ``peer_access`` the open fails unless the memory is on ``device`` itself.
    """
    runtime = _runtime()
    handle = _handle(raw)
    flags = runtime.cudaIpcMemLazyEnablePeerAccess if peer_access else 0
    with on_device(device):
        ptr = _check("cudaIpcOpenMemHandle", runtime.cudaIpcOpenMemHandle(handle, flags))
    return int(ptr)


def close_handle(ptr: int, device: int) -> None:
    with on_device(device):
        _check("cudaIpcCloseMemHandle", _runtime().cudaIpcCloseMemHandle(ptr))


def allocation_size(raw: bytes, device: int) -> int:
    """The size of the allocation a handle names: opened in ``device``'s context, asked,
    closed again.

    Which GPU the memory is on cannot be asked: for an IPC mapping CUDA reports the device
    that opened it (cudaPointerGetAttributes) or 0 (CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL),
    as seen on two GPUs of one host. The registration's device_id is trusted, as Triton does.
    """
    with on_device(device):
        ptr = open_handle(raw, device)
        try:
            _, size = _check("cuMemGetAddressRange", _driver().cuMemGetAddressRange(ptr))
        finally:
            close_handle(ptr, device)
    return int(size)


# --- copies and memory ------------------------------------------------------------------


def copy(dst: int, src: int, nbytes: int, stream: int = LEGACY_STREAM) -> None:
    """Copy ``nbytes`` between any two addresses (host or device, by UVA), then wait."""
    if nbytes == 0:
        return
    runtime = _runtime()
    kind = runtime.cudaMemcpyKind.cudaMemcpyDefault
    _check("cudaMemcpyAsync", runtime.cudaMemcpyAsync(dst, src, nbytes, kind, stream))
    _check("cudaStreamSynchronize", runtime.cudaStreamSynchronize(stream))


def make_stream_wait(consumer: int, producer: int = LEGACY_STREAM) -> None:
    """Order work later queued on ``consumer`` after what is queued on ``producer`` now."""
    if consumer == producer:
        return
    runtime = _runtime()
    event = _check(
        "cudaEventCreateWithFlags",
        runtime.cudaEventCreateWithFlags(runtime.cudaEventDisableTiming),
    )
    try:
        _check("cudaEventRecord", runtime.cudaEventRecord(event, producer))
        _check("cudaStreamWaitEvent", runtime.cudaStreamWaitEvent(consumer, event, 0))
    finally:
        _runtime().cudaEventDestroy(event)


class DeviceBuffer:
    """``nbytes`` of device memory (``cudaMalloc``: it can be exported by IPC handle, for
    BLS), back to a small per-process cache when the object goes.

    ``cudaFree`` waits for the whole device, so freed buffers are kept (up to
    ``CACHE_BYTES``) and handed out again for the same size; the next user's copy into
    one runs on the legacy stream, after the work queued on it before.
    """

    __slots__ = ("__weakref__", "device", "nbytes", "ptr")
    CACHE_BYTES: Final = 1 << 30
    _free: dict[tuple[int, int], list[int]] = {}  # (device, size) -> pointers
    _cached = 0
    _lock = threading.Lock()

    def __init__(self, nbytes: int, device: int) -> None:
        self.device, self.nbytes = device, nbytes
        size = max(nbytes, 1)
        with DeviceBuffer._lock:
            free = DeviceBuffer._free.get((device, size))
            if free:
                DeviceBuffer._cached -= size
                self.ptr = free.pop()
                return
        with on_device(device):
            self.ptr = int(_check("cudaMalloc", _runtime().cudaMalloc(size)))

    def __del__(self) -> None:
        ptr, self.ptr = self.ptr, 0
        if not ptr:
            return
        size = max(self.nbytes, 1)
        with DeviceBuffer._lock:
            if DeviceBuffer._cached + size <= DeviceBuffer.CACHE_BYTES:
                DeviceBuffer._free.setdefault((self.device, size), []).append(ptr)
                DeviceBuffer._cached += size
                return
        try:
            with on_device(self.device):
                _runtime().cudaFree(ptr)
        except Exception:  # interpreter shutdown: the process frees it
            pass


_pinned_lock = threading.Lock()
_pinned: set[int] = set()


def pin_host_memory(address: int, nbytes: int) -> None:
    """Page-lock host memory (an arena) once so that copies to and from it run at full
    speed; idempotent per address."""
    with _pinned_lock:
        if address in _pinned:
            return
        runtime = _runtime()
        flags = runtime.cudaHostRegisterPortable
        _check("cudaHostRegister", runtime.cudaHostRegister(address, nbytes, flags))
        _pinned.add(address)


def unpin_host_memory(address: int) -> None:
    with _pinned_lock:
        if address not in _pinned:
            return
        _pinned.discard(address)
        _runtime().cudaHostUnregister(address)


# --- BLS: memory handed to another worker (added with BLS) -------------------------------


def address_range(ptr: int) -> tuple[int, int]:
    """The base and size of the allocation (or IPC mapping) ``ptr`` points into."""
    result = _driver().cuMemGetAddressRange(ptr)
    _status("cuMemGetAddressRange", result)
    return int(result[1]), int(result[2])


def export_handle(ptr: int, device: int, synchronized: bool = False) -> tuple[bytes, int, int]:
    """The IPC handle of the allocation ``ptr`` (on ``device``) points into, ``ptr``'s
    offset in it, and the allocation's base, once the work queued on the legacy stream is
    done (another process reads the memory next; ``synchronized``: the caller has just
    waited for the whole device). Only ``cudaMalloc`` memory has such a handle (torch's
    caching allocator's does; memory from the stream-ordered pool does not)."""
    if synchronized and _current(device):  # the usual: nothing to wait for or switch
        return _export(ptr)
    with on_device(device):
        if not synchronized:
            _status("cudaStreamSynchronize", _runtime().cudaStreamSynchronize(LEGACY_STREAM))
        return _export(ptr)


def _export(ptr: int) -> tuple[bytes, int, int]:
    base, _ = address_range(ptr)
    result = _runtime().cudaIpcGetMemHandle(base)
    _status("cudaIpcGetMemHandle", result)
    return ctypes.string_at(result[1].getPtr(), HANDLE_SIZE), ptr - base, base


def synchronize(device: int) -> None:
    """Wait for the work queued on ``device``'s legacy stream (and so on every blocking
    stream): memory handed to another process must be written before it reads."""
    with on_device(device):
        _check("cudaStreamSynchronize", _runtime().cudaStreamSynchronize(LEGACY_STREAM))


def synchronize_device(device: int) -> None:
    """Wait for all the work this process queued on ``device``, on every stream: memory
    given back to another process may be written by it next."""
    with on_device(device):
        _check("cudaDeviceSynchronize", _runtime().cudaDeviceSynchronize())


# --- BLS: interprocess events (fences between workers) ------------------------------------

EVENT_HANDLE_SIZE: Final = 64  # sizeof(cudaIpcEventHandle_t)


def create_ipc_event(device: int) -> tuple[Any, bytes]:
    """A new interprocess event on ``device`` (no timing, as IPC requires) and its handle,
    which another process opens with :func:`open_ipc_event`."""
    runtime = _runtime()
    flags = runtime.cudaEventDisableTiming | runtime.cudaEventInterprocess
    with on_device(device):
        event = _check("cudaEventCreateWithFlags", runtime.cudaEventCreateWithFlags(flags))
        try:
            handle = _check("cudaIpcGetEventHandle", runtime.cudaIpcGetEventHandle(event))
        except CudaError:
            runtime.cudaEventDestroy(event)
            raise
    return event, ctypes.string_at(handle.getPtr(), EVENT_HANDLE_SIZE)


def open_ipc_event(raw: bytes, device: int) -> Any:
    """Open another process's interprocess event in ``device``'s context (dear:
    callers open each handle once)."""
    if len(raw) != EVENT_HANDLE_SIZE:
        raise ValueError(f"a cudaIpcEventHandle_t is {EVENT_HANDLE_SIZE} bytes, not {len(raw)}")
    runtime = _runtime()
    handle = runtime.cudaIpcEventHandle_t()
    ctypes.memmove(handle.getPtr(), raw, EVENT_HANDLE_SIZE)
    with on_device(device):
        return _check("cudaIpcOpenEventHandle", runtime.cudaIpcOpenEventHandle(handle))


def record_event(event: Any, device: int) -> None:
    """Mark the work queued now on ``device``'s legacy stream (and so on every blocking
    stream) with ``event``: waiting for it waits for that work."""
    _on(device, "cudaEventRecord", _runtime().cudaEventRecord, event, LEGACY_STREAM)


def stream_wait_event(event: Any, device: int) -> None:
    """Order the work later queued on ``device``'s legacy stream (and so on every blocking
    stream) after ``event``'s last record; the CPU does not wait."""
    _on(device, "cudaStreamWaitEvent", _runtime().cudaStreamWaitEvent, LEGACY_STREAM, event, 0)


def _on(device: int, call: str, function: Callable[..., Any], *args: Any) -> None:
    """A call that returns only its status, made with ``device`` current (once per fence:
    the usual case, the sole device, switches nothing)."""
    if _current(device):
        _status(call, function(*args))
        return
    with on_device(device):
        _status(call, function(*args))


def synchronize_event(event: Any) -> None:
    """Wait on the CPU until the work ``event``'s last record marks is done."""
    _status("cudaEventSynchronize", _runtime().cudaEventSynchronize(event))


_NOT_READY: Final = 600  # cudaErrorNotReady, in every CUDA release


def event_done(event: Any) -> bool:
    """Whether the work ``event``'s last record marks is done (the CPU does not wait)."""
    result = _runtime().cudaEventQuery(event)
    status = int(result[0])
    if status == _NOT_READY:
        return False
    if status != 0:
        _check("cudaEventQuery", result)
    return True
