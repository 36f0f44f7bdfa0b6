"""The building blocks of the messages between the server and workers: where a tensor's
bytes are (:class:`TensorRef`), the tagged base of every message, and timings.

:mod:`dlserve.ipc.messages` re-exports these; import them from there.
"""

from __future__ import annotations

import enum

import msgspec

ParamValue = bool | int | float | str


class Where(enum.IntEnum):
    """Where a tensor's bytes live."""

    PAYLOAD = 0  # in this frame's payload, at offset
    INPUT_ARENA = 1  # the server-owned input arena of this worker
    OUTPUT_ARENA = 2  # the worker-owned output arena
    NOWHERE = 3  # no data (output written into a client region elsewhere)
    CLIENT_REGION = 4  # a client's shared-memory object (key), at offset from its start
    CUDA_REGION = 5  # a client's GPU allocation (handle, device), at offset from its start
    PEER_ARENA = 6  # another worker's arena (BLS): region = arena id, key = path to open it
    CUDA_IPC = 7  # GPU memory of another worker (BLS): handle, device, offset in the allocation


class TensorRef(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    name: str
    datatype: str
    shape: list[int]
    where: Where
    offset: int
    nbytes: int
    region: int = 0  # CLIENT_REGION: the region's id (workers map each region once, by id)
    key: str = ""  # CLIENT_REGION: the shared-memory object's name
    handle: bytes = b""  # CUDA_REGION / CUDA_IPC: the allocation's cudaIpcMemHandle_t
    device: int = 0  # CUDA_REGION / CUDA_IPC: the GPU the allocation is on
    lend: int = 0  # CUDA_IPC output lent to a BLS caller: its id in the owner (region: owner)


class Fence(msgspec.Struct, array_like=True, gc=False):
    """GPU work of the sender on ``device``, marked by an interprocess CUDA event (its
    ``cudaIpcEventHandle_t``): the receiver orders what it does with the tensors after it,
    instead of the sender waiting for that work before it sends (direct BLS calls)."""

    device: int
    handle: bytes


class _Msg(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class Timings(msgspec.Struct, array_like=True, gc=False):
    """CLOCK_MONOTONIC nanoseconds, comparable across processes on one host."""

    input_start: int
    infer_start: int
    infer_end: int
    output_end: int
