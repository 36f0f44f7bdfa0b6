"""What makes an HTTP/2 request's header list well-formed (RFC 9113 8.2 and 8.3): the
request pseudo-header fields, each once and before the others (``:method``, ``:scheme``
and a non-empty ``:path``), lowercase field names of token characters, no
connection-specific fields, ``te`` only as ``trailers``, values without NUL, CR, LF or
whitespace at their ends, and a ``content-length`` of digits. A malformed request is a
stream error of type PROTOCOL_ERROR (8.1.1); the connection checks each distinct list
once (a client's repeated block decodes to the same list object)."""

from __future__ import annotations

import re
from typing import Final

from dlserve.server.transport.h2.hpack_codec import Headers

_PSEUDO: Final = frozenset((":method", ":scheme", ":path", ":authority"))
_REQUIRED: Final = frozenset((":method", ":scheme", ":path"))
_CONNECTION_SPECIFIC: Final = frozenset(
    ("connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade")
)
_BAD_NAME: Final = re.compile(r"[^!#$%&'*+\-.^_`|~0-9a-z]")
_BAD_VALUE: Final = re.compile(r"[\x00\r\n]|^[ \t]|[ \t]$")


class Malformed(Exception):
    """A request the server answers with RST_STREAM PROTOCOL_ERROR."""


def request_length(headers: Headers) -> int:
    """The request's content-length (-1: none) if its header list is well-formed."""
    seen: set[str] = set()
    length = -1
    regular = False
    for name, value in headers:
        if name[:1] == ":":
            if regular or name not in _PSEUDO or name in seen:
                raise Malformed(f"pseudo-header field {name!r} misplaced, unknown or repeated")
            seen.add(name)
            if name == ":path" and not value:
                raise Malformed("empty :path")
            continue
        regular = True
        if not name or _BAD_NAME.search(name):
            raise Malformed(f"field name {name!r} not lowercase token characters")
        if name in _CONNECTION_SPECIFIC or (name == "te" and value != "trailers"):
            raise Malformed(f"connection-specific field {name!r}")
        if _BAD_VALUE.search(value):
            raise Malformed(f"field {name!r} has a value HTTP/2 forbids")
        if name == "content-length":
            if not value.isdigit() or length >= 0:
                raise Malformed("bad content-length")
            length = int(value)
    if not seen >= _REQUIRED:
        raise Malformed("a request pseudo-header field is missing")
    return length


def trailers_ok(headers: Headers) -> bool:
    """Whether a trailer section is well-formed: no pseudo-header fields (8.1)."""
    return not any(name[:1] == ":" for name, _ in headers)
