"""What one HTTP/1.1 listener bounds, and its defaults (docs/network-edge.md).

Each timeout is checked by the listener's sweep (``listener.py``), a timer that runs a few
times a second and looks at each connection's one deadline: a request costs a few
attribute writes and no timer of its own. ``None`` turns a bound off.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Http1Limits:
    max_connections: int | None = 4096  # more are refused with a 503
    header_timeout: float | None = 30.0  # a request's head, from its first byte (or the
    # connection's start) to its end; else a 408 and close
    body_timeout: float | None = 30.0  # each window this long while a body is read must
    body_min_rate: int = 1024  # bring at least this many bytes per second; else a 408
    idle_timeout: float | None = 300.0  # keep-alive between requests; then the server closes
    send_timeout: float | None = 60.0  # the longest a client may leave a response unread
    # (the write buffer past its high-water mark); then the connection is dropped

    def sweep_interval(self) -> float:
        """How often deadlines are checked: a quarter of the shortest timeout, at most
        once a second and at least every 50 ms."""
        timeouts = [t for t in (self.header_timeout, self.body_timeout, self.idle_timeout,
                                self.send_timeout) if t is not None]  # fmt: skip
        return max(0.05, min([1.0, *(t / 4 for t in timeouts)]))
