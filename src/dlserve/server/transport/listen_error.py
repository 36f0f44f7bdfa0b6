"""The transports' own error: a listener that cannot start (its address is taken, its
socket path is not a socket, its TLS files do not load). The server's wiring turns it into
the server's fatal error; the transports know nothing of dlserve's errors."""

from __future__ import annotations


class ListenError(Exception):
    """A listener cannot start; the message says where and why."""
