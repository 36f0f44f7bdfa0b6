"""A request a worker has been sent and has not finished: who hears its outcome, and what
of the worker's memory it holds until then. The handle keeps them by rid; its decoupled
streams share that table (a decoupled request lives until its final response)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dlserve.ipc import messages as m

if TYPE_CHECKING:
    from dlserve.server.core.instances.decoupled_replies import StreamSink
    from dlserve.server.core.instances.replies import Outcome

ReplyCallback = Callable[["Outcome"], None]


@dataclass(slots=True)
class Pending:
    callback: ReplyCallback
    arena_offsets: list[int]  # its inputs in the input arena (freed once it is done)
    keep: bool = False  # its outputs in the output arena are viewed in place (WorkItem.keep)
    lend: bool = False  # ... or lent to a BLS caller (WorkItem.lend)
    stream: StreamSink | None = None  # decoupled: where its responses go
    refs: list[m.TensorRef] | None = None  # where its inputs were placed (rescheduling)
    notices: bool = False  # the callback also hears a ``deferred`` notice
