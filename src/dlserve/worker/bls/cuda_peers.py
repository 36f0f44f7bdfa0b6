"""GPU tensors between models (BLS) by CUDA IPC handle: the interface, and a small
implementation on cuda-python.

BLS is written against :class:`CudaIpc`, the four calls it needs, implemented on
``tensors/cuda_ipc.py``; the ``gpu`` tests in ``tests/e2e/test_bls_gpu.py`` run it on a
GPU. CUDA will not export IPC-opened memory again, so a tensor received by handle is
passed on by the same handle (``find``), and one in a client's CUDA region by that
region's handle (``tensors._gpu_ref``).

A sender exports the allocation that holds a pointer (``cuMemGetAddressRange`` gives
its base, ``cuIpcGetMemHandle`` its handle) and sends (handle, offset). A receiver
opens each handle once and keeps it open (an open is dear), so a
pointer is ``base + offset``. The sender keeps the memory alive until the receiver's
response is back (inputs) or until the receiver gives it back (outputs); a receiver
gives an output back only once its own queued work is done (:func:`settle`).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterable
from collections.abc import Set as AbstractSet
from typing import Any, Protocol

from dlserve.ipc import messages as m
from dlserve.pb_utils.exceptions import TritonModelException
from dlserve.tensors import cuda_ipc, dlpack


class CudaIpc(Protocol):
    def export(self, ptr: int, device: int, synchronized: bool = False) -> tuple[bytes, int]:
        """The IPC handle of the allocation holding ``ptr``, and ``ptr``'s offset in it.
        Waits for the work queued on the device (the receiver reads from another process)
        unless the caller has just waited for all of it (``synchronized``)."""

    def open(self, handle: bytes, device: int) -> int:
        """The base address of an exported allocation in this process (opened once)."""

    def find(
        self, ptr: int, settled: AbstractSet[int] = frozenset()
    ) -> tuple[bytes, int, int] | None:
        """(handle, device, offset) when ``ptr`` lies in an allocation opened here: a
        tensor received by handle is passed on by the same handle. Waits for the work
        queued on the device, as ``export`` does, unless it is one of ``settled`` (the
        caller has just waited for all of their work)."""

    def close_all(self) -> None: ...


_ipc: CudaIpc | None = None
_lock = threading.Lock()


def ipc() -> CudaIpc:
    """The process's CUDA IPC implementation; raises when cuda-python is missing."""
    global _ipc
    if _ipc is not None:  # the usual case, told without the lock
        return _ipc
    with _lock:
        if _ipc is None:
            _ipc = _Ipc()
        return _ipc


def synchronize(device: int) -> None:
    """Wait for the work queued on ``device``: another process reads the memory next."""
    try:
        cuda_ipc.synchronize(device)
    except (cuda_ipc.CudaError, cuda_ipc.CudaUnavailable) as exc:
        raise TritonModelException(f"passing a GPU tensor to another model: {exc}") from None


_unsettled: set[int] = set()  # devices of lent GPU outputs given back since the last settle


def given_back(give_back: Callable[[int, int], None], region: int, lend: int, device: int) -> None:
    """A lent GPU output is no longer held here (a finalizer): it goes back with the next
    frame, which waits for this process's work on ``device`` first (:func:`settle`)."""
    _unsettled.add(device)
    give_back(region, -lend)


def settle() -> None:
    """Before a frame gives lent GPU outputs back: wait for the work this process queued on
    their devices, on any stream, which may still read them (the lender's next tensors may
    take the memory at once). Called after the give-backs were taken from their queue, so
    each was noted here before."""
    while _unsettled:
        device = _unsettled.pop()
        try:
            cuda_ipc.synchronize_device(device)
        except (cuda_ipc.CudaError, cuda_ipc.CudaUnavailable):
            pass  # the context is broken: no work of ours runs on it any more


# -- fences: direct calls order GPU work between workers by interprocess events ------------
#
# A worker that hands GPU memory to another (a caller's inputs, a callee's lent outputs and
# the caller's inputs it wrote into) marks the work it queued on the legacy stream with its
# own interprocess event, one per device, recorded again for each fence, instead of waiting
# for that work before it sends. The receiver orders its reads after the mark: the callee
# waits on the CPU before ``execute`` (its model sees inputs that are ready, as always), the
# caller queues the wait on its legacy stream (its lent outputs are ready there, as a DLPack
# producer's tensors are) and its own later waits (a synchronize, a give-back's settle, the
# copy into a client's region) come after it. A record made later than the one a fence was
# sent for only marks more work, so one event per device is enough.


class _EveryDevice(frozenset[int]):
    """Stands for every device in a ``settled`` set: nothing is waited for (fences go)."""

    def __contains__(self, item: object) -> bool:
        return True


EVERY_DEVICE: AbstractSet[int] = _EveryDevice()

_own_events: dict[int, tuple[Any, bytes]] = {}  # device -> (event, handle): this process's
_opened_events: dict[bytes, Any] = {}  # other processes' events, by handle, opened once
_events_lock = threading.Lock()
_no_events = False  # interprocess events cannot be made here: senders wait instead


def fences(devices: Iterable[int]) -> list[m.Fence]:
    """Fences over the work this process queued on ``devices`` so far, for a receiver to
    wait on; where interprocess events cannot be made (said once on stderr), the work is
    waited for here instead and no fence is returned for it."""
    marks: list[m.Fence] = []
    for device in devices:
        try:
            own = _own_event(device)
            if own is None:
                cuda_ipc.synchronize_device(device)
                continue
            cuda_ipc.record_event(own[0], device)
        except (cuda_ipc.CudaError, cuda_ipc.CudaUnavailable) as exc:
            raise TritonModelException(f"passing GPU tensors to another model: {exc}") from None
        marks.append(m.Fence(device, own[1]))
    return marks


def unfinished(marks: list[m.Fence]) -> list[m.Fence]:
    """Of this process's fences, those over work the GPU has not finished: asked just
    before they are sent (by then it often has), so that the receiver skips waiting for the
    others. A fence that cannot be asked about is kept: the receiver's wait reports it."""
    kept: list[m.Fence] = []
    for mark in marks:
        own = _own_events.get(mark.device)
        try:
            if own is not None and own[1] == mark.handle and cuda_ipc.event_done(own[0]):
                continue
        except (cuda_ipc.CudaError, cuda_ipc.CudaUnavailable):
            pass
        kept.append(mark)
    return kept


def _own_event(device: int) -> tuple[Any, bytes] | None:
    global _no_events
    found = _own_events.get(device)
    if found is not None or _no_events:
        return found
    with _events_lock:
        if device not in _own_events and not _no_events:
            try:
                _own_events[device] = cuda_ipc.create_ipc_event(device)
            except cuda_ipc.CudaError as exc:
                _no_events = True
                sys.stderr.write(
                    f"dlserve worker: CUDA interprocess events are not available ({exc}); "
                    "GPU tensors passed to other models are waited for before they are sent\n"
                )
        return _own_events.get(device)


def wait_fences(marks: list[m.Fence], on_cpu: bool) -> None:
    """Order what this process does next after another's fences: wait for them here
    (``on_cpu``), or queue the wait on each device's legacy stream."""
    try:
        for mark in marks:
            event = _opened_events.get(mark.handle)
            if event is None:
                event = _open_event(mark)
            if on_cpu:
                cuda_ipc.synchronize_event(event)
            else:
                cuda_ipc.stream_wait_event(event, mark.device)
    except (cuda_ipc.CudaError, cuda_ipc.CudaUnavailable, ValueError) as exc:
        raise TritonModelException(f"waiting for another model's GPU work: {exc}") from None


def _open_event(mark: m.Fence) -> Any:
    with _events_lock:
        event = _opened_events.get(mark.handle)
        if event is None:
            event = cuda_ipc.open_ipc_event(mark.handle, mark.device)
            _opened_events[mark.handle] = event
        return event


def gpu_info(ptr: int, shape: list[int], dtype: Any, device: int) -> dlpack.DLTensorInfo:
    return dlpack.DLTensorInfo(ptr, tuple(shape), None, dtype, dlpack.CUDA, device, False)


class _Ipc:
    """CudaIpc on ``tensors.cuda_ipc`` (cuda-python)."""

    def __init__(self) -> None:
        if not cuda_ipc.available():
            raise TritonModelException(
                "GPU tensors between models need CUDA and cuda-python (pip install 'dlserve[gpu]')"
            )
        self._opened: dict[bytes, tuple[int, int, int]] = {}  # handle -> (base, size, device)
        self._exported: dict[bytes, int] = {}  # handle -> base, of this process's allocations
        self._lock = threading.Lock()

    def export(self, ptr: int, device: int, synchronized: bool = False) -> tuple[bytes, int]:
        try:
            handle, offset, base = cuda_ipc.export_handle(ptr, device, synchronized)
        except (cuda_ipc.CudaError, cuda_ipc.CudaUnavailable) as exc:
            raise TritonModelException(f"passing a GPU tensor to another model: {exc}") from None
        with self._lock:
            self._exported[handle] = base
        return handle, offset

    def open(self, handle: bytes, device: int) -> int:
        found = self._opened.get(handle)  # the usual case, told without the lock
        if found is not None:
            return found[0]
        with self._lock:
            found = self._opened.get(handle)
            if found is not None:
                return found[0]
            if handle in self._exported:  # our own memory, back from a callee or caller
                return self._exported[handle]
            try:
                base = cuda_ipc.open_handle(handle, device)
                with cuda_ipc.on_device(device):
                    _, size = cuda_ipc.address_range(base)
            except (cuda_ipc.CudaError, cuda_ipc.CudaUnavailable, ValueError) as exc:
                raise TritonModelException(f"opening another model's GPU tensor: {exc}") from None
            self._opened[handle] = (base, size, device)
            return base

    def find(
        self, ptr: int, settled: AbstractSet[int] = frozenset()
    ) -> tuple[bytes, int, int] | None:
        found = None
        with self._lock:
            for handle, (base, size, device) in self._opened.items():
                if base <= ptr < base + size:
                    found = handle, device, ptr - base
                    break
        if found is not None and found[1] not in settled:
            try:
                cuda_ipc.synchronize(found[1])
            except cuda_ipc.CudaError as exc:
                raise TritonModelException(f"passing a GPU tensor on: {exc}") from None
        return found

    def close_all(self) -> None:
        with self._lock:
            for base, _, device in self._opened.values():
                try:
                    cuda_ipc.close_handle(base, device)
                except cuda_ipc.CudaError:
                    pass
            self._opened.clear()
