"""A worker's mappings of clients' system shared-memory regions.

A region is mapped the first time a request brings it (the whole object, from its start:
any offset works, page-aligned or not) and stays mapped, keyed by its id, until the server
says it is gone. The object's descriptor stays open so that its *current* size can be
asked before every view: a client that shrank its object after registering it must get a
clear error, not crash the worker with SIGBUS (touching a mapped page past the end of a
file is SIGBUS).

What stays unguarded: a client that shrinks its object *while* a model reads or writes it.
No check can close that window; the client only hurts its own request and the worker.

A CUDA region's IPC handle is opened once, on the GPU the memory lives on, the first time a
request brings it, and closed when the server says the region is gone: never per request
(an open costs far more than a request's own work).
"""

from __future__ import annotations

import mmap
import os
import sys
from dataclasses import dataclass
from typing import Any

import numpy.typing as npt

from dlserve.ipc import messages as m
from dlserve.pb_utils.exceptions import TritonError
from dlserve.tensors import cuda_ipc
from dlserve.tensors.arena import buffer_address, object_size, open_client_object


@dataclass(slots=True)
class _Mapping:
    fd: int
    key: str
    map: mmap.mmap | None  # None while the object is empty
    address: int = 0  # where ``map`` starts in this process
    pinned: bool = False  # page-locked for CUDA (GPU outputs are copied into it)
    pin_failed: bool = False  # CUDA would not page-lock it: not asked again

    @property
    def size(self) -> int:
        return 0 if self.map is None else len(self.map)

    def unpin(self) -> None:
        if self.pinned:
            self.pinned = False
            try:
                cuda_ipc.unpin_host_memory(self.address)
            except (cuda_ipc.CudaUnavailable, cuda_ipc.CudaError):
                pass  # unmapping releases the pages either way

    def close(self) -> None:
        """Unmap (once no view of it is left, if some still are) and close the descriptor."""
        self.unpin()
        if self.map is not None:
            try:
                self.map.close()
            except BufferError:
                pass  # a view outlives the request: the mapping goes with the last one
            self.map = None
        os.close(self.fd)


class ClientRegions:
    """The regions this worker has mapped, by region id."""

    def __init__(self) -> None:
        self._mapped: dict[int, _Mapping] = {}
        self._cuda: dict[int, tuple[int, int]] = {}  # region id -> (pointer, device)
        self.cuda_opens = 0  # handles opened so far (each region once)
        self._cuda_handles: dict[int, tuple[bytes, int]] = {}  # BLS: region id -> (handle, size)

    def cuda_pointer(self, ref: m.TensorRef, what: str) -> int:
        """The device address of ``ref``'s bytes in a client's CUDA region."""
        mapped = self._cuda.get(ref.region)
        if mapped is None:
            try:
                pointer = cuda_ipc.open_handle(ref.handle, ref.device)
            except (cuda_ipc.CudaUnavailable, cuda_ipc.CudaError) as exc:
                raise TritonError(
                    f"unable to open the CUDA shared memory holding {what} on GPU "
                    f"{ref.device}: {exc}",
                    TritonError.INTERNAL,
                ) from None
            mapped = self._cuda[ref.region] = (pointer, ref.device)
            self._cuda_handles[ref.region] = (ref.handle, _allocation_size(pointer, ref.device))
            self.cuda_opens += 1
        return mapped[0] + ref.offset

    def view(self, ref: m.TensorRef, what: str) -> memoryview:
        """A writable view of ``ref.nbytes`` bytes at ``ref.offset`` of the region's object.

        Raises TritonError (INVALID_ARG) when the object is now too small for them.
        """
        mapping = self._mapped.get(ref.region)
        if mapping is None:
            mapping = self._mapped[ref.region] = _open(ref.key, what)
        end = ref.offset + ref.nbytes
        size = object_size(mapping.fd)
        if end > size:
            raise TritonError(
                f"the shared memory object '{ref.key}' holding {what} is {size} bytes now, too "
                f"small for bytes {ref.offset} to {end}: it was truncated after it was "
                "registered",
                TritonError.INVALID_ARG,
            )
        if ref.nbytes == 0:
            return memoryview(bytearray())
        if end > mapping.size:  # the object grew past our mapping of it
            _remap(mapping, size)
        assert mapping.map is not None
        return memoryview(mapping.map)[ref.offset : end]

    def pin(self, ref: m.TensorRef) -> None:
        """Page-lock a system region (mapped already) the first time a GPU output is copied
        into it, so that the copy runs at full speed; a failure only costs speed."""
        mapping = self._mapped.get(ref.region)
        if mapping is None or mapping.map is None or mapping.pinned or mapping.pin_failed:
            return
        try:
            cuda_ipc.pin_host_memory(mapping.address, mapping.size)
        except (cuda_ipc.CudaUnavailable, cuda_ipc.CudaError):
            mapping.pin_failed = True
            return
        mapping.pinned = True

    def locate(self, array: npt.NDArray[Any]) -> m.TensorRef | None:
        """Where ``array``'s bytes are, when they lie in a region mapped here: a BLS call can
        pass them to another worker by reference (name, datatype and shape left empty)."""
        if not self._mapped or not array.flags.c_contiguous or array.nbytes == 0:
            return None  # no region mapped here (the usual): no address to work out
        start = int(array.__array_interface__["data"][0])
        for region, mapping in self._mapped.items():
            if mapping.map is not None and mapping.address <= start:
                offset = start - mapping.address
                if offset + array.nbytes <= mapping.size:
                    return m.TensorRef(
                        "", "", [], m.Where.CLIENT_REGION, offset, array.nbytes, region,
                        mapping.key,
                    )  # fmt: skip
        return None

    def locate_cuda(self, ptr: int, nbytes: int) -> m.TensorRef | None:
        """A CUDA_REGION ref when GPU memory at ``ptr`` lies in a client's CUDA region mapped
        here: a BLS call passes it on by the client's handle (name, datatype, shape empty)."""
        for region, (pointer, device) in self._cuda.items():
            handle, size = self._cuda_handles.get(region, (b"", 0))
            if handle and pointer <= ptr and ptr + nbytes <= pointer + size:
                return m.TensorRef("", "", [], m.Where.CUDA_REGION, ptr - pointer, nbytes,
                                   region, handle=handle, device=device)  # fmt: skip
        return None

    def unmap(self, regions: list[int]) -> None:
        for region in regions:
            mapping = self._mapped.pop(region, None)
            if mapping is not None:
                mapping.close()
            self._cuda_handles.pop(region, None)
            opened = self._cuda.pop(region, None)
            if opened is not None:
                try:
                    cuda_ipc.close_handle(*opened)
                except cuda_ipc.CudaError as exc:  # the mapping is gone either way
                    print(f"dlserve worker: closing a CUDA IPC mapping: {exc}", file=sys.stderr)

    def close(self) -> None:
        self.unmap([*self._mapped, *self._cuda])

    def __len__(self) -> int:
        return len(self._mapped) + len(self._cuda)


def _allocation_size(pointer: int, device: int) -> int:
    try:
        with cuda_ipc.on_device(device):
            return cuda_ipc.address_range(pointer)[1]
    except (cuda_ipc.CudaUnavailable, cuda_ipc.CudaError):
        return 0  # unknown: not passed on by reference


def _open(key: str, what: str) -> _Mapping:
    try:
        fd = open_client_object(key)
    except (OSError, ValueError) as exc:
        raise TritonError(
            f"unable to open the shared memory object '{key}' holding {what}: {exc}",
            TritonError.INVALID_ARG,
        ) from None
    mapping = _Mapping(fd, key, None)
    try:
        _remap(mapping, object_size(fd))
    except BaseException:
        mapping.close()
        raise
    return mapping


def _remap(mapping: _Mapping, size: int) -> None:
    """Map the whole object as it is now, in place of the old mapping."""
    mapping.unpin()  # pinned again, at the new address, when a GPU output next comes
    if mapping.map is not None:
        try:
            mapping.map.close()
        except BufferError:
            pass  # views of the old mapping keep it until they go
    mapping.map = mmap.mmap(mapping.fd, size) if size > 0 else None
    mapping.address = 0 if mapping.map is None else buffer_address(mapping.map)
