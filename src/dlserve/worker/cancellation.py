"""Requests whose client went away, as the worker sees them (mixed into ModelRunner):
``is_cancelled()`` turns true for a request executing, and one that has not started is
answered "Request was cancelled" without running."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from dlserve import pb_utils as pb_utils
from dlserve.ipc import messages as m
from dlserve.pb_utils.exceptions import TritonError
from dlserve.worker.link import link

if TYPE_CHECKING:
    from dlserve.worker.runner import Item


class Cancellation:
    """Mixed into ModelRunner, which sets these attributes."""

    _live: dict[int, pb_utils.InferenceRequest]  # executing, by rid
    _started: int  # the newest rid started (rids grow)
    _cancelled_early: set[int]  # cancelled before they started

    @property
    def decoupled(self) -> bool:
        raise NotImplementedError

    def _error_reply(self, rid: int, exc: BaseException) -> m.InferDone:
        raise NotImplementedError

    def cancel(self, rid: int) -> None:
        """The server says request ``rid``'s client has gone: ``is_cancelled()`` turns true,
        and a request not started yet is not run at all."""
        request = self._live.get(rid)
        if request is not None:
            request._cancelled = True
        elif rid > self._started:
            self._cancelled_early.add(rid)

    def _skip_cancelled(
        self, items: Sequence[Item], worker: link.WorkerLink | None
    ) -> tuple[list[tuple[m.InferDone, list[memoryview]]], Sequence[Item]]:
        """The requests cancelled while they waited (answered here, not run), and the others.

        Cancels already read ahead behind them are dispatched first (no system call)."""
        if worker is not None:
            worker.poll(buffered_only=True)
        for item in items:
            if item.rid > self._started:
                self._started = item.rid
        if not self._cancelled_early:
            return [], items
        replies: list[tuple[m.InferDone, list[memoryview]]] = []
        kept: list[Item] = []
        for item in items:
            if item.rid not in self._cancelled_early:
                kept.append(item)
                continue
            self._cancelled_early.discard(item.rid)
            error = TritonError("Request was cancelled", TritonError.CANCELLED)
            if self.decoupled and worker is not None:
                worker.send(m.StreamResponse(item.rid, final=True, error=error.message(),
                                             error_code="cancelled"))  # fmt: skip
            else:
                replies.append((self._error_reply(item.rid, error), []))
        return replies, kept


def upstream(items: Sequence[Item]) -> list[str]:
    """The instances upstream of the requests executing (their BLS call chains): their
    union."""
    if len(items) == 1:
        return items[0].chain
    return sorted({name for item in items for name in item.chain})
