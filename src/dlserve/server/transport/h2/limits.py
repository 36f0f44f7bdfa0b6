"""What one HTTP/2 connection allows its client, and how it keeps a connection alive or
ends an idle one: the SETTINGS the server advertises and enforces (RFC 9113 6.5.2), the
budgets against floods of cheap frames (rapid reset, CVE-2023-44487; SETTINGS, PING,
empty frames), gRPC's keepalive policy (grpc/doc/keepalive.md, with Triton's defaults)
and an idle timeout. The server's options fill one ``Limits``; every connection reads it.

``Budget`` is a token bucket a connection spends one token from per costly frame; it
reads the clock only when its tokens run out, so a frame costs a subtraction. It holds a
fifth of a second's worth: a flood ends after little work on each connection it opens.
A connection that has spent half of either budget is flooding, or about to be told to
stop: its next turns of the loop come later than others' (``connection.py``)."""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Limits:
    max_concurrent_streams: int = 1024  # SETTINGS_MAX_CONCURRENT_STREAMS
    max_header_list_size: int = 16384  # SETTINGS_MAX_HEADER_LIST_SIZE (RFC 9113 6.5.2 size)
    max_frame_size: int = 16384  # SETTINGS_MAX_FRAME_SIZE, RFC 9113's default
    # per second (and at once): client resets of started streams and stream errors we send
    max_resets_per_s: int = 200
    # per second (and at once): SETTINGS, PING, PRIORITY, unknown frames, empty frames
    max_control_frames_per_s: int = 1000
    keepalive_time_ms: int = 7_200_000  # the server PINGs an open connection this often
    keepalive_timeout_ms: int = 20_000  # and closes it when no ACK comes within this
    keepalive_permit_without_calls: bool = False  # PINGs on a connection without calls
    max_pings_without_data: int = 2  # keepalive PINGs sent with no data between (0: any)
    min_recv_ping_interval_without_data_ms: int = 300_000  # client PINGs closer: a strike
    max_ping_strikes: int = 2  # strikes past this: GOAWAY ENHANCE_YOUR_CALM (0: none)
    max_connection_idle_ms: int = 300_000  # no stream open this long: GOAWAY (0: never)


class Budget:
    """``rate`` tokens a second, at most a fifth of a second's worth (and 20) at once, so
    that a connection that floods is closed after little work; ``rate`` 0: no limit."""

    __slots__ = ("burst", "rate", "stamp", "tokens")

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self.burst = float(max(rate // 5, 20))
        self.tokens = self.burst
        self.stamp = time.monotonic()

    def spend(self) -> bool:
        """Take a token; False when there is none left (the peer went past the rate)."""
        self.tokens -= 1
        if self.tokens >= 0 or not self.rate:
            return True
        now = time.monotonic()
        self.tokens = self._refilled(now)
        self.stamp = now
        return self.tokens >= 0

    def spending(self) -> bool:
        """Whether over half the tokens are gone now: the peer sends these frames much
        faster than the rate, or in a burst (twenty calls cancelled at once, for resets)."""
        if not self.rate or self.tokens >= self.burst / 2:
            return False
        return self._refilled(time.monotonic()) < self.burst / 2

    def _refilled(self, now: float) -> float:
        """The tokens there are at ``now``: those left, and the rate's since ``stamp``."""
        return min(self.burst, self.tokens + (now - self.stamp) * self.rate)
