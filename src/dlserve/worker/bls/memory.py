"""Where a BLS caller's tensors can travel by reference (``bls.tensors.BlsMemory``), as a
worker answers it: client regions, the input arena, other workers' arenas mapped here,
client CUDA regions; or a copy staged once in the output arena."""

from __future__ import annotations

from typing import Any

import numpy.typing as npt

from dlserve.ipc import messages as m
from dlserve.tensors.arena import Arena, ShmSegment, buffer_address
from dlserve.worker.bls.peers import PeerArenas
from dlserve.worker.client_regions import ClientRegions
from dlserve.worker.outputs import INLINE_OUTPUT_LIMIT


class SharedMemoryForBls:
    """The worker's memory its BLS calls can pass by reference (one per instance; the link
    holds it as its ``BlsMemory``)."""

    def __init__(
        self, regions: ClientRegions, peers: PeerArenas, input_arena: ShmSegment, output: Arena
    ) -> None:
        self.regions, self.peers = regions, peers
        self.input_arena = input_arena
        self._input_base = buffer_address(input_arena.buffer)  # where the caller's inputs are
        self.output_arena = output  # where a copy is staged

    def locate(self, array: npt.NDArray[Any]) -> m.TensorRef | None:
        """A ref to ``array``'s bytes when another worker can map them: in a client's
        region, in this worker's input arena (the caller's own input), or in another
        worker's arena mapped here (a callee's output, passed on)."""
        found = self.regions.locate(array)
        if found is not None or not array.flags.c_contiguous or array.nbytes == 0:
            return found
        address = int(array.__array_interface__["data"][0])
        start = address - self._input_base
        if self._input_base and start >= 0 and start + array.nbytes <= self.input_arena.size:
            return m.TensorRef("", "", [], m.Where.INPUT_ARENA, start, array.nbytes)
        return self.peers.locate(address, array.nbytes)  # another callee's output, passed on

    def stage(self, data: memoryview) -> m.TensorRef | None:
        """Copy a large tensor once into this worker's output arena for a callee to map;
        the server releases the space once the callee is done. None: send it inline."""
        if data.nbytes <= INLINE_OUTPUT_LIMIT:
            return None
        offset = self.output_arena.alloc(data.nbytes)
        if offset is None:
            return None
        self.output_arena.view(offset, data.nbytes)[:] = data
        return m.TensorRef("", "", [], m.Where.OUTPUT_ARENA, offset, data.nbytes)

    def unstage(self, offset: int) -> None:
        """A staged copy the callee no longer reads (a direct call's: the caller frees it)."""
        self.output_arena.free(offset)

    def locate_gpu(self, ptr: int, nbytes: int) -> m.TensorRef | None:
        """A ref to GPU memory another worker can open by a handle it may already have: a
        client's CUDA region (the callee opens it once per region)."""
        return self.regions.locate_cuda(ptr, nbytes)

    def peer_view(self, ref: m.TensorRef) -> memoryview:
        return self.peers.view(ref)
