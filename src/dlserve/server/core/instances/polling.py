"""Polling instead of sleeping, in the server's loop (for workers' replies and clients' next
requests) and in the workers (for their next frame): ``--reply-poll-us``,
``--request-poll-us`` and ``--busy-poll-us``.

Waking a sleeping process costs more than a small request's own work; docs/architecture.md
(Decisions) says why these are the defaults, the performance page has the numbers.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Sized

_busy_poll_us = 0
REPLY_POLL_US = 2000
REQUEST_POLL_US = 2000
_reply_poll_s = REPLY_POLL_US / 1e6
_request_poll_us = REQUEST_POLL_US


def set_busy_poll(
    microseconds: int, reply_poll_us: int = REPLY_POLL_US, request_poll_us: int = REQUEST_POLL_US
) -> None:
    """Trade CPU for latency. ``microseconds`` (``--busy-poll-us``): workers started from
    now on poll for their next frame this long before sleeping, and while requests are in
    flight the server's loop polls for replies instead of sleeping. ``reply_poll_us``
    (``--reply-poll-us``): the server's loop polls this long after it last sent a
    request, for the reply and for clients' next requests, then sleeps. ``request_poll_us``
    (``--request-poll-us``): workers started from now on poll for their next frame at
    least this long before sleeping. Waking a sleeping process costs more than a small
    request's own work."""
    global _busy_poll_us, _reply_poll_s, _request_poll_us
    if min(microseconds, reply_poll_us, request_poll_us) < 0:
        raise ValueError("polling time must be >= 0 microseconds")
    _busy_poll_us = microseconds
    _reply_poll_s = reply_poll_us / 1e6
    _request_poll_us = request_poll_us


def busy_poll_us() -> int:
    return _busy_poll_us


def worker_poll_us() -> int:
    """How long a worker polls for its next frame before it sleeps."""
    return max(_busy_poll_us, _request_poll_us)


class _Spinner:
    """Keep the event loop polling (a callback that reschedules itself makes the loop poll
    its selector without sleeping) for ``_reply_poll_s`` after the last request went to a
    worker, and with ``--busy-poll-us`` also as long as any is in flight. A reply is then
    read as soon as it arrives, and so is a client's next request: at one client it comes
    a few tens of microseconds after the response went out, and the loop need not be
    woken for it. Each turn yields the CPU (``sched_yield``): on a machine with few cores
    the worker and the clients run first, and the loop spins only on a core nobody else
    wants."""

    def __init__(self) -> None:
        self._waiting: list[Sized] = []  # workers' requests in flight (busy polling)
        self._running = False
        self._until = 0.0  # time.monotonic() after which the loop may sleep again
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop it polls on

    @property
    def running(self) -> bool:
        return self._running

    def hold(self, pending: Sized) -> None:
        """A request went to a worker (``pending``: that worker's requests in flight): poll
        for the next ``_reply_poll_s``, or while ``pending`` is not empty with busy
        polling; nothing when the loop does not poll at all."""
        if not (_busy_poll_us or _reply_poll_s):
            return
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            # the first request on this loop: one that ended while it polled (a server
            # stopped, another started in the same process) left its state behind
            self._loop, self._waiting, self._running = loop, [], False
        # time.monotonic, not loop.time(): uvloop's clock moves in milliseconds
        self._until = time.monotonic() + _reply_poll_s
        if _busy_poll_us and pending not in self._waiting:
            self._waiting.append(pending)
        if not self._running:
            self._running = True
            loop.call_soon(self._spin, loop)

    def _spin(self, loop: asyncio.AbstractEventLoop) -> None:
        """One turn of polling on ``loop``, which schedules the next."""
        if loop is not self._loop:
            return  # a turn left on a loop another one has taken over from
        if self._waiting:
            self._waiting = [p for p in self._waiting if p]
        if self._waiting or time.monotonic() < self._until:
            os.sched_yield()  # anyone runnable (a worker, a client) goes first
            loop.call_soon(self._spin, loop)
        else:
            self._running = False


spinner = _Spinner()
