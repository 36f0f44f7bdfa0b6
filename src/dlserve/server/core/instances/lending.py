"""How workers lend each other memory for BLS: tensors passed by reference.

Each worker's two arenas are memfds the server keeps open, so another worker can map
them through /proc (the path travels in a PEER_ARENA ref). A BLS callee's output that
stays in its output arena is *lent* to the caller, who gives it back when its arrays are
gone (PeerRelease) or when it dies; GPU outputs are lent the same way by CUDA IPC handle
(counted as (owner's output arena, -lend id)). Each worker handle owns one
:class:`ArenaLending`; ``ARENA_OWNERS`` finds it by arena id.
"""

from __future__ import annotations

import itertools
import os
import weakref
from collections.abc import Callable, Iterable
from typing import Final

from dlserve.ipc import messages as m
from dlserve.tensors.arena import ShmSegment
from dlserve.types import ArenaSpan, CudaSpan, OutputTensor

_arena_ids = itertools.count(1)
# Every live worker's lending, by its arenas' ids: BLS tensors are passed between them.
ARENA_OWNERS: Final[weakref.WeakValueDictionary[int, ArenaLending]] = weakref.WeakValueDictionary()

Send = Callable[[m.ServerToWorker], None]


def _proc_path(segment: ShmSegment) -> str:
    """A path that reopens ``segment``'s memfd (this process keeps it open)."""
    return f"/proc/{os.getpid()}/fd/{segment.fd}"


class ArenaLending:
    """One worker's side of lending: its arenas as others map them, the outputs it lent
    coming back (arena space through ``release_output``, the handle's batched release;
    GPU memory in a Release frame through ``send``), and what it borrowed of other
    workers' outputs as a BLS caller, which goes back when it says so or dies."""

    def __init__(
        self, input_segment: ShmSegment, output_segment: ShmSegment,
        release_output: Callable[[int], None], send: Send,
    ) -> None:  # fmt: skip
        # The memfds stay open: other workers map these arenas through /proc (BLS).
        self.arena_ids = (next(_arena_ids), next(_arena_ids))  # (input, output)
        self.arena_paths = (_proc_path(input_segment), _proc_path(output_segment))
        self._borrowed: set[tuple[int, int]] = set()  # (arena id, offset) lent to this caller
        self._release_output = release_output
        self._send = send
        for arena_id in self.arena_ids:
            ARENA_OWNERS[arena_id] = self

    def arena_span(self, where: m.Where, offset: int, nbytes: int) -> ArenaSpan:
        """Bytes in this worker's input or output arena, for another worker to map."""
        index = 0 if where == m.Where.INPUT_ARENA else 1
        return ArenaSpan(self.arena_ids[index], self.arena_paths[index], offset, nbytes)

    def borrow(self, span: ArenaSpan | CudaSpan) -> None:
        """This worker (a BLS caller) now maps ``span``, another worker's output: the space
        goes back when it says so (PeerRelease) or when it dies. A GPU output is counted
        as (its owner's output arena, -lend id)."""
        if isinstance(span, CudaSpan):
            self._borrowed.add((span.owner, -span.lend_id))
        else:
            self._borrowed.add((span.arena_id, span.offset))

    def release_lent(self, offset: int) -> None:
        """An output kept in this worker's output arena for a BLS caller that never mapped it
        (or is done with it); a negative offset is a lent GPU output's lend id."""
        if offset >= 0:
            self._release_output(offset)
        else:
            self._send(m.Release([], gpu=[-offset]))

    def on_peer_release(self, msg: m.PeerRelease, payload: memoryview) -> None:
        """The worker is done with outputs it borrowed (a frame of its own)."""
        for arena, offset in zip(msg.arenas, msg.offsets, strict=True):
            self.give_back(arena, offset)

    def give_back(self, arena: int, offset: int) -> None:
        if (arena, offset) not in self._borrowed:
            return  # given back already (say, after this worker's death)
        self._borrowed.discard((arena, offset))
        owner = ARENA_OWNERS.get(arena)
        if owner is not None and arena == owner.arena_ids[1]:
            owner.release_lent(offset)

    def give_back_all(self) -> None:
        """The worker died: whatever it borrowed goes back."""
        for arena, offset in list(self._borrowed):
            self.give_back(arena, offset)

    def release_staged(self, offsets: list[int]) -> None:
        """A callee is done with inputs this worker staged in its output arena for it."""
        if offsets:
            self._send(m.Release(offsets))

    def stop(self) -> None:
        """This worker is gone: what it borrowed goes back, the others drop its arenas."""
        self.give_back_all()
        for arena_id in self.arena_ids:
            ARENA_OWNERS.pop(arena_id, None)
        for other in dict.fromkeys(ARENA_OWNERS.values()):  # each once (two arenas each)
            other._send(m.DropArenas(list(self.arena_ids)))


def return_lent(outputs: Iterable[OutputTensor]) -> None:
    """Lent outputs nobody reads any more: their space goes back to the worker that lent
    them (a GPU output by its lend id)."""
    for output in outputs:
        lent = output.lent
        if isinstance(lent, CudaSpan):
            owner = ARENA_OWNERS.get(lent.owner)
            if owner is not None:
                owner.release_lent(-lent.lend_id)
        elif lent is not None:
            owner = ARENA_OWNERS.get(lent.arena_id)
            if owner is not None:
                owner.release_lent(lent.offset)
