"""Flow control of a decoupled request's responses, in the worker (mixed into WorkerLink):
a model's ``send()`` waits while the consumer has not taken enough of the earlier ones.
docs/architecture.md ("A stream's responses are flow-controlled end to end") has the
whole path."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Final

from dlserve.ipc import messages as m

if TYPE_CHECKING:
    from dlserve.worker.link.link import Frame

HOLD_RECHECK_S: Final = 0.2  # a held send that reads looks at its window this often at least


class FlowControl:
    """Mixed into WorkerLink, which provides these."""

    _lock: threading.Lock
    _windows: dict[int, Window]
    _reading: bool
    _closed: bool
    stopping: bool

    def _notify(self) -> None:
        raise NotImplementedError

    def _wait(self, timeout: float | None) -> None:
        raise NotImplementedError

    def _read(self, timeout: float | None) -> Frame | None:
        raise NotImplementedError

    def _stop_reading(self) -> None:
        raise NotImplementedError

    def _dispatch(self, frame: Frame) -> None:
        raise NotImplementedError

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
            self._notify()

    def hold_send(self, rid: int, cancelled: Callable[[], bool]) -> bool:
        """Wait until request ``rid`` may send one more response (its consumer has taken
        enough of the earlier ones) and count it; whichever thread waits reads frames
        meanwhile, as :meth:`wait_answer` does. False when the send is to be given up:
        ``cancelled()`` turned true (the consumer left), the request has ended (its final
        flag went out from another thread), the worker is stopping, or the server has gone
        away."""
        while True:
            with self._lock:
                while True:
                    window = self._windows.get(rid)
                    if window is None:
                        return False  # the final flag has gone: nothing follows it
                    if cancelled() or self.stopping or self._closed:
                        return False
                    if window.has_room():
                        window.responses += 1
                        return True
                    if not self._reading:
                        self._reading = True
                        break
                    self._wait(None)
            # a timeout: the final flag sent by another thread is no frame to wake us
            frame = self._read(HOLD_RECHECK_S)
            with self._lock:
                self._stop_reading()
                if frame is not None:
                    self._dispatch(frame)

    def sent_bytes(self, rid: int, nbytes: int) -> None:
        """The response just counted by :meth:`hold_send` carries ``nbytes``."""
        with self._lock:
            window = self._windows.get(rid)
            if window is not None:
                window.nbytes += nbytes


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
