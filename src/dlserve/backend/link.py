"""The worker's link to the server, for what model code sends or asks synchronously.

A worker serves one blocking channel from one thread: ``serve()`` reads a frame,
runs the model, writes the reply. Model code that needs an answer from the server
(``Metric.value()``) runs *inside* that loop, so nobody else would read the answer:
:meth:`WorkerLink.call` sends its request and reads frames itself until the reply
with its call id arrives. Any other frame read meanwhile (Infer, Release, Shutdown)
is queued, and :meth:`WorkerLink.recv` gives queued frames to ``serve()`` first.

Links are per thread (the server can run several in-process workers as threads of
one process, each with its own channel). A worker process also makes its link the
process-wide default, so that threads the model starts can still send metric
updates; sends are serialized by a lock, replies are read only by the serving thread.
"""

from __future__ import annotations

import itertools
import select
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Final

from dlserve.backend.errors import TritonModelException
from dlserve.ipc import messages as m
from dlserve.ipc.channel import BlockingChannel, ChannelClosed

Frame = tuple[m.ServerToWorker, memoryview]
CALL_TIMEOUT_S: Final = 30.0


class WorkerLink:
    """One worker's channel, shared by the serve loop and the model code it runs."""

    def __init__(self, channel: BlockingChannel[m.ServerToWorker]) -> None:
        self._channel = channel
        self._queued: deque[Frame] = deque()
        self._send_lock = threading.Lock()
        self._call_ids = itertools.count(1)
        self._owner = threading.get_ident()
        self._closed = False
        self.model_name = ""  # set when a Load arrives; Logger lines carry it

    def send(self, message: m._Msg, payload: Sequence[bytes | memoryview] = ()) -> None:
        """Send one frame; raises ChannelClosed when the server has gone away."""
        with self._send_lock:
            try:
                self._channel.send(message, payload)
            except (BrokenPipeError, ConnectionResetError) as exc:
                self._closed = True
                raise ChannelClosed(f"connection closed: {exc}") from None

    def recv(self) -> Frame:
        """The next frame for the serve loop: queued ones first. Raises ChannelClosed."""
        if self._queued:
            return self._queued.popleft()
        if self._closed:
            raise ChannelClosed("connection closed")
        return self._channel.recv()

    def next_call_id(self) -> int:
        return next(self._call_ids)

    def call(
        self, request: m.MetricValueCall, timeout: float = CALL_TIMEOUT_S
    ) -> m.MetricValueReply:
        """Send ``request`` and return the server's reply to it, queueing other frames."""
        if threading.get_ident() != self._owner:
            raise TritonModelException(
                "this call needs an answer from the server and can only be made from the "
                "thread that runs initialize/execute/finalize"
            )
        self.send(request)
        deadline = time.monotonic() + timeout
        while True:
            msg, payload = self._recv_before(deadline, timeout)
            if isinstance(msg, m.MetricValueReply) and msg.call == request.call:
                return msg
            self._queued.append((msg, payload))

    def _recv_before(self, deadline: float, timeout: float) -> Frame:
        remaining = deadline - time.monotonic()
        if self._channel.buffered():
            return self._channel.recv()
        readable, _, _ = select.select([self._channel.fileno()], [], [], max(remaining, 0.0))
        if not readable:
            raise TritonModelException(f"the server did not answer within {timeout:g} s")
        try:
            return self._channel.recv()
        except ChannelClosed:
            self._closed = True
            raise TritonModelException("the connection to the server is closed") from None


_local = threading.local()
_process_link: WorkerLink | None = None


def install(link: WorkerLink, *, process_wide: bool = False) -> None:
    """Make ``link`` this thread's link (and the process default when asked)."""
    global _process_link
    _local.link = link
    if process_wide:
        _process_link = link


def uninstall(link: WorkerLink) -> None:
    global _process_link
    if getattr(_local, "link", None) is link:
        _local.link = None
    if _process_link is link:
        _process_link = None


def current() -> WorkerLink | None:
    """This thread's link, else the process default; None outside a worker."""
    link: WorkerLink | None = getattr(_local, "link", None)
    return link if link is not None else _process_link
