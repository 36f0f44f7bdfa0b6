"""Where a request's input bytes travel to a worker: in the frame, the arena, a region.

Small inputs ride inline in the frame's payload; larger ones are copied once into
the worker's input arena; inputs in a client's shared-memory region are described,
never copied (the worker maps the region).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Final

import msgspec

from dlserve.ipc import messages as m
from dlserve.tensors.arena import Arena
from dlserve.types import ArenaSpan, CudaSpan, InputTensor, RegionSpan

# Where an input without bytes is: a client's region, or a BLS caller's memory.
Span = RegionSpan | ArenaSpan | CudaSpan
INLINE_INPUT_LIMIT: Final = 64 * 1024
NO_SPANS: Final[Mapping[str, Span]] = {}

if TYPE_CHECKING:
    from dlserve.server.core.instances.handle import WorkItem

# A request placed for sending: its rid, the request, its input refs, its arena offsets.
Placed = tuple[int, "WorkItem", list[m.TensorRef], list[int]]


def region_ref(name: str, datatype: str, span: Span, shape: list[int] | None = None) -> m.TensorRef:
    """A tensor in (or an output going to) a client region, or in a BLS caller's memory
    (another worker's arena, GPU memory by IPC handle); ``nbytes`` is the span's size."""
    if isinstance(span, CudaSpan):
        return m.TensorRef(
            name, datatype, shape or [], m.Where.CUDA_IPC, span.offset, span.byte_size,
            handle=span.handle, device=span.device,
        )  # fmt: skip
    if isinstance(span, ArenaSpan):
        return m.TensorRef(
            name, datatype, shape or [], m.Where.PEER_ARENA, span.offset, span.byte_size,
            span.arena_id, span.path,
        )  # fmt: skip
    if span.is_cuda:
        return m.TensorRef(
            name, datatype, shape or [], m.Where.CUDA_REGION, span.offset, span.byte_size,
            span.region_id, handle=span.handle, device=span.device,
        )  # fmt: skip
    return m.TensorRef(
        name, datatype, shape or [], m.Where.CLIENT_REGION, span.offset, span.byte_size,
        span.region_id, span.key,
    )  # fmt: skip


def place_inputs(
    arena: Arena,
    inputs: list[InputTensor],
    spans: Mapping[str, Span],
    payload: list[memoryview],
    inline_offset: int,
) -> tuple[list[m.TensorRef], int, list[int]]:
    """The refs of ``inputs``; inline bytes are appended to ``payload`` from
    ``inline_offset``. Returns the refs, the next inline offset and the arena offsets
    taken (the caller frees them once the worker has answered)."""
    refs: list[m.TensorRef] = []
    offsets: list[int] = []
    try:
        for tensor in inputs:
            data = tensor.data
            if data is None:  # in a client's region: the worker maps it, nothing to copy
                refs.append(region_ref(tensor.name, tensor.datatype, spans[tensor.name],
                                       list(tensor.shape)))  # fmt: skip
                continue
            nbytes = data.nbytes
            arena_offset = arena.alloc(nbytes) if nbytes > INLINE_INPUT_LIMIT else None
            if arena_offset is None:  # small, or no arena space: inline in the frame
                where, offset = m.Where.PAYLOAD, inline_offset
                payload.append(data)
                inline_offset += nbytes
            else:  # the one copy, into the shared memory the worker maps
                where, offset = m.Where.INPUT_ARENA, arena_offset
                arena.view(arena_offset, nbytes)[:] = data.cast("B")
                offsets.append(arena_offset)
            shape = list(tensor.shape)
            refs.append(m.TensorRef(tensor.name, tensor.datatype, shape, where, offset, nbytes))
    except BaseException:
        for offset in offsets:
            arena.free(offset)
        raise
    return refs, inline_offset, offsets


def replace_inputs(
    refs: list[m.TensorRef], inputs: list[InputTensor], payload: list[memoryview],
    inline_offset: int,
) -> tuple[list[m.TensorRef], int]:  # fmt: skip
    """A rescheduled request's refs again: what is in the arena or a client region stays
    where it was placed the first time; inline bytes go into this frame's payload."""
    again: list[m.TensorRef] = []
    for ref, tensor in zip(refs, inputs, strict=True):
        if ref.where == m.Where.PAYLOAD and tensor.data is not None:
            payload.append(tensor.data)
            ref = msgspec.structs.replace(ref, offset=inline_offset)
            inline_offset += ref.nbytes
        again.append(ref)
    return again, inline_offset


def infer_message(placed: list[Placed], release: list[int]) -> m.Infer | m.InferBatch:
    """An Infer frame for one request, an InferBatch for several."""
    if len(placed) == 1:
        rid, item, refs, _ = placed[0]
        return m.Infer(
            rid=rid, request_id=item.request_id, inputs=refs, outputs=item.outputs,
            parameters=item.parameters, release=release, output_regions=_output_regions(item),
            chain=item.chain, lend=item.lend, correlation_id=item.correlation_id,
            flags=item.flags, trace_id=item.trace_id, timeout_us=item.timeout_us,
        )  # fmt: skip
    items = [_batch_item(rid, item, refs) for rid, item, refs, _ in placed]
    return m.InferBatch(items, release)


def _batch_item(rid: int, item: WorkItem, refs: list[m.TensorRef]) -> m.BatchItem:
    return m.BatchItem(
        rid=rid, request_id=item.request_id, inputs=refs, outputs=item.outputs,
        parameters=item.parameters, output_regions=_output_regions(item), chain=item.chain,
        lend=item.lend, correlation_id=item.correlation_id, flags=item.flags,
        trace_id=item.trace_id, timeout_us=item.timeout_us,
    )  # fmt: skip


def _output_regions(item: WorkItem) -> list[m.TensorRef]:
    if not item.output_spans:
        return []
    return [region_ref(name, "", span) for name, span in item.output_spans.items()]
