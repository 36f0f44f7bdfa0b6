"""Flow control of a decoupled request's responses, in the worker: a model's ``send()``
waits while the consumer has not taken enough of the earlier ones. The worker's link owns
one (``WorkerLink.flow``) and routes the server's Credit to it; a held send reads the
link's frames meanwhile, as a BLS wait does. docs/architecture.md ("A stream's responses
are flow-controlled end to end") has the whole path."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Final, Protocol

from dlserve.ipc import messages as m

HOLD_RECHECK_S: Final = 0.2  # a held send that reads looks at its window this often at least


class FrameReader(Protocol):
    """What flow control needs of the link that owns it: its reader role."""

    closed: bool  # the server has gone away

    def claim_reader(self, timeout: float | None) -> bool:
        """(The link's lock held.) Take the reader role if it is free, else wait for a
        notification (False)."""
        ...

    def read_and_route(self, timeout: float | None) -> None:
        """(The role held, the lock not.) Read one frame, give the role up, route it."""
        ...

    def notify(self) -> None:
        """(The link's lock held.) Wake the threads waiting on it."""
        ...


class FlowControl:
    """The windows of one worker's decoupled requests, guarded by its link's lock."""

    def __init__(self, reader: FrameReader, lock: threading.Lock) -> None:
        self._reader = reader
        self._lock = lock  # the link's: Credit is routed with it held
        self._windows: dict[int, Window] = {}  # by rid: responses not yet taken
        self.stopping = False  # Shutdown has come: a send held back is given up

    # -- flow control: a decoupled request's responses not yet taken ----------------------
    def open_window(self, rid: int) -> None:
        """Request ``rid`` is decoupled: its sends are counted against the window."""
        with self._lock:  # a rescheduled request (iterative sequences) keeps its window
            self._windows.setdefault(rid, Window())

    def close_window(self, rid: int) -> None:
        """Request ``rid`` has sent its final flag: credit that comes later is dropped, and
        a send still held (another thread's) is given up."""
        with self._lock:
            self._windows.pop(rid, None)
            self._reader.notify()

    def hold_send(self, rid: int, cancelled: Callable[[], bool]) -> bool:
        """Wait until request ``rid`` may send one more response (its consumer has taken
        enough of the earlier ones) and count it; whichever thread waits reads frames
        meanwhile, as ``WorkerLink.wait_answer`` does. False when the send is to be given
        up: ``cancelled()`` turned true (the consumer left), the request has ended (its final
        flag went out from another thread), the worker is stopping, or the server has gone
        away."""
        while True:
            with self._lock:
                while True:
                    window = self._windows.get(rid)
                    if window is None:
                        return False  # the final flag has gone: nothing follows it
                    if cancelled() or self.stopping or self._reader.closed:
                        return False
                    if window.has_room():
                        window.responses += 1
                        return True
                    if self._reader.claim_reader(None):
                        break
            # a timeout: the final flag sent by another thread is no frame to wake us
            self._reader.read_and_route(HOLD_RECHECK_S)

    def sent_bytes(self, rid: int, nbytes: int) -> None:
        """The response just counted by :meth:`hold_send` carries ``nbytes``."""
        with self._lock:
            window = self._windows.get(rid)
            if window is not None:
                window.nbytes += nbytes

    def credit(self, frame: tuple[m.Credit, memoryview]) -> None:
        """The consumer took responses (the link routes Credit here, its lock held)."""
        msg = frame[0]
        window = self._windows.get(msg.rid)
        if window is not None:
            window.responses -= msg.responses
            window.nbytes -= msg.nbytes

    def stop(self) -> None:
        """Shutdown has come (the link's lock held): sends held back are given up."""
        self.stopping = True


class Window:
    """A decoupled request's responses sent and not yet taken by its consumer (guarded by
    the link's lock): at most WINDOW_RESPONSES of them, or WINDOW_BYTES (one beyond)."""

    __slots__ = ("nbytes", "responses")

    def __init__(self) -> None:
        self.responses = 0
        self.nbytes = 0

    def has_room(self) -> bool:
        return self.responses < m.WINDOW_RESPONSES and (
            self.nbytes < m.WINDOW_BYTES or self.responses == 0
        )
