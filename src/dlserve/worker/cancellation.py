"""Requests whose client went away, as the worker sees them: ``is_cancelled()`` turns true
for a request executing, and one that has not started is not run (its runner answers it
"Request was cancelled"). The server's Cancel frame may come before its request does, or
while the request runs, on whichever thread reads the link."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from dlserve import pb_utils as pb_utils

if TYPE_CHECKING:
    from dlserve.worker.runner import Item


class Cancellation:
    """One instance's requests as cancels find them: executing, or not started yet."""

    def __init__(self) -> None:
        # by rid: whoever runs a request adds it and takes it out once it is answered
        self.executing: dict[int, pb_utils.InferenceRequest] = {}
        self._started = 0  # the newest rid started (rids grow)
        self._early: set[int] = set()  # cancelled before they started

    def cancel(self, rid: int) -> None:
        """The server says request ``rid``'s client has gone: ``is_cancelled()`` turns true,
        and a request not started yet is not run at all."""
        request = self.executing.get(rid)
        if request is not None:
            request._cancelled = True
        elif rid > self._started:
            self._early.add(rid)

    def start(self, items: Sequence[Item]) -> tuple[Sequence[Item], Sequence[Item]]:
        """``items`` are about to run: those cancelled while they waited (not to be run),
        and the others."""
        for item in items:
            if item.rid > self._started:
                self._started = item.rid
        if not self._early:  # the usual
            return (), items
        cancelled: list[Item] = []
        kept: list[Item] = []
        for item in items:
            if item.rid in self._early:
                self._early.discard(item.rid)
                cancelled.append(item)
            else:
                kept.append(item)
        return cancelled, kept


def upstream(items: Sequence[Item]) -> list[str]:
    """The instances upstream of the requests executing (their BLS call chains): their
    union."""
    if len(items) == 1:
        return items[0].chain
    return sorted({name for item in items for name in item.chain})
