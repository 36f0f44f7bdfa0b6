"""HTTP request and response bodies: their headers read once, size limits enforced before
and while a body is read, Content-Encoding undone, responses compressed on request, and
the JSON header's end found (Inference-Header-Content-Length)."""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from dlserve import errors

Message = MutableMapping[str, Any]
INFLATE_SLICE = 4 << 20  # a compressed body is inflated this much at a time
Receive = Callable[[], Awaitable[Message]]


class BodyRefusedError(errors.InvalidArgumentError):
    """The body is larger than the limit: refused before (or while) it is read."""


@dataclass(slots=True)
class Headers:
    content_length: int | None = None
    content_encoding: bytes = b""
    accept_encoding: bytes = b""
    header_length: bytes | None = None


def scan_headers(raw: list[tuple[bytes, bytes]]) -> Headers:
    found = Headers()
    for name, value in raw:
        if name == b"content-length":
            try:
                found.content_length = int(value)
            except ValueError:
                raise errors.InvalidArgumentError(
                    f"Unable to parse Content-Length, got: {value.decode('latin-1')}"
                ) from None
        elif name == b"inference-header-content-length":
            found.header_length = value
        elif name == b"content-encoding":
            found.content_encoding = value.strip().lower()
        elif name == b"accept-encoding":
            found.accept_encoding = value.lower()
    return found


def _too_large(size: int, limit: int) -> BodyRefusedError:
    return BodyRefusedError(
        f"request JSON size of {size} bytes exceeds the maximum allowed input size of {limit} "
        "bytes. Use --http-max-input-size to increase the limit."
    )


async def read_body(receive: Receive, content_length: int | None, limit: int) -> bytes:
    """The whole request body, refused unread when Content-Length is over ``limit``
    and refused as soon as a streamed (chunked) body grows past it."""
    if content_length is not None and content_length > limit:
        raise _too_large(content_length, limit)
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise errors.CancelledError("the client closed the connection")
        chunk: bytes = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def decompress(body: bytes, encoding: bytes, limit: int) -> bytes | bytearray:
    """Undo Content-Encoding gzip or deflate; the result is bounded by ``limit`` too.

    Inflated a slice of ``INFLATE_SLICE`` bytes at a time, each bounded before it is
    made (zlib's ``max_length``: nothing past ``limit`` + 1 is ever inflated), with the
    event loop free between slices: a bomb costs at most ``limit`` + 1 bytes and holds the
    loop for one slice's inflating at a time."""
    if encoding in (b"", b"identity"):
        return body
    if encoding not in (b"gzip", b"deflate"):
        raise errors.UnsupportedError("Unsupported compression type")
    inflater = zlib.decompressobj(wbits=47)  # 32 + 15: zlib or gzip header, found by itself
    out = bytearray()
    pending: bytes = body
    while True:
        try:
            piece = inflater.decompress(pending, min(INFLATE_SLICE, limit + 1 - len(out)))
        except zlib.error as exc:
            raise errors.InvalidArgumentError(
                f"failed to decompress the request body: {exc}"
            ) from None
        out += piece
        if len(out) > limit:
            raise errors.InvalidArgumentError(
                f"decompressed request size exceeds the maximum allowed input size of {limit} bytes"
            )
        pending = inflater.unconsumed_tail
        if inflater.eof or not (pending or piece):
            break
        await asyncio.sleep(0)  # the next slice after the loop's other work
    if not inflater.eof:
        raise errors.InvalidArgumentError("failed to decompress the request body: it is truncated")
    return out


def response_encoding(accept: bytes) -> bytes:
    """The first of gzip / deflate that Accept-Encoding names (and does not refuse)."""
    if not accept:
        return b""
    for token in accept.split(b","):
        name, _, params = token.partition(b";")
        name = name.strip()
        if name in (b"gzip", b"deflate") and params.replace(b" ", b"") not in (b"q=0", b"q=0.0"):
            return name
    return b""


def compress(parts: list[bytes | memoryview], encoding: bytes) -> bytes:
    deflater = zlib.compressobj(wbits=31 if encoding == b"gzip" else 15)
    return b"".join([*(deflater.compress(p) for p in parts), deflater.flush()])


def header_length(raw: bytes | None, body_length: int) -> int:
    """Where the JSON header ends: Inference-Header-Content-Length, else the whole body."""
    if raw is None:
        return body_length
    try:
        length = int(raw)
    except ValueError:
        raise errors.InvalidArgumentError(
            f"Unable to parse Inference-Header-Content-Length, got: {raw.decode('latin-1')}"
        ) from None
    if length < 0 or length > body_length:
        raise errors.InvalidArgumentError(
            f"inference header size should be in range (0, {body_length}), got: {length}"
        )
    return length  # 0: a raw binary request, the whole body is the one input's data
