"""HPACK (RFC 7541) for the HTTP/2 connection: a decoder with a dynamic table, and an
encoder that needs none. Pure: bytes in, header lists out.

The ``hpack`` package's Decoder takes each of a gRPC call's eight or so headers through
several Python objects; this one decodes a block in one pass, and a block it has decoded
before, with the table unchanged since, in one lookup (a gRPC client sends the same
indexed block call after call). Huffman-coded strings are decoded by ``hpack``'s table
and checked by encoding them again (its decoder lets padding of zeros through; RFC 7541
5.2 wants the EOS prefix, all ones).

A decoder is given the connection's SETTINGS_MAX_HEADER_LIST_SIZE: past it, a block's
fields are no longer kept (the block is still read to its end, so that the dynamic table
stays in step) and ``HeaderListTooLarge`` is raised at its end. The connection bounds a
block's length, so reading it is bounded work.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Final

from hpack.huffman import HuffmanEncoder
from hpack.huffman_constants import REQUEST_CODES, REQUEST_CODES_LENGTH
from hpack.huffman_table import decode_huffman
from hpack.table import HeaderTable

Headers = list[tuple[str, str]]

_STATIC: Final = [(n.decode("latin-1"), v.decode("latin-1")) for n, v in HeaderTable.STATIC_TABLE]
_ENTRY_OVERHEAD: Final = 32  # RFC 7541 4.1
_CACHE_LIMIT: Final = 64
_HUFFMAN: Final = HuffmanEncoder(REQUEST_CODES, REQUEST_CODES_LENGTH)


class HpackError(Exception):
    """A header block that cannot be decoded: a COMPRESSION_ERROR of the connection."""


class HeaderListTooLarge(Exception):
    """A block decoded in full whose header list is larger than the decoder's limit."""


def _integer(block: bytes, pos: int, prefix_bits: int) -> tuple[int, int]:
    limit = (1 << prefix_bits) - 1
    value = block[pos] & limit
    pos += 1
    if value < limit:
        return value, pos
    shift = 0
    while True:
        if pos >= len(block) or shift > 28:
            raise HpackError("bad integer")
        byte = block[pos]
        pos += 1
        value += (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, pos


def _string(block: bytes, pos: int) -> tuple[str, int]:
    if pos >= len(block):
        raise HpackError("truncated string")
    huffman = block[pos] & 0x80
    length, pos = _integer(block, pos, 7)
    end = pos + length
    if end > len(block):
        raise HpackError("truncated string")
    raw = block[pos:end]
    if not huffman:
        return raw.decode("latin-1"), end
    try:
        decoded = decode_huffman(raw)
    except Exception as exc:  # hpack's own HPACKDecodingError
        raise HpackError(f"bad Huffman string: {exc}") from None
    if _HUFFMAN.encode(decoded) != raw:  # padding not the EOS prefix, or too long
        raise HpackError("bad Huffman padding")
    return decoded.decode("latin-1"), end


class Decoder:
    """One connection's decoder: its dynamic table lives as long as the connection."""

    def __init__(self, max_table_size: int = 4096, max_list_size: int = 2**31) -> None:
        self._limit = max_table_size  # what our SETTINGS allow the client
        self._max_list = max_list_size  # SETTINGS_MAX_HEADER_LIST_SIZE
        self._max_size = max_table_size  # what the client chose, up to that
        self._entries: deque[tuple[str, str]] = deque()  # newest first
        self._size = 0
        self._cache: dict[bytes, Headers] = {}  # blocks of indexed fields only

    def decode(self, block: bytes) -> Headers:
        """The header list of ``block``. The list returned must not be changed."""
        cached = self._cache.get(block)
        if cached is not None:
            return cached
        out: Headers = []
        pos, end = 0, len(block)
        indexed_only = True
        room = self._max_list  # what the list may still take (RFC 9113 6.5.2 sizes)
        updates = 0  # table size updates: at most two, before the first field
        while pos < end:
            byte = block[pos]
            if byte & 0x80:  # indexed field
                index, pos = _integer(block, pos, 7)
                field = self._get(index)
                room -= len(field[0]) + len(field[1]) + _ENTRY_OVERHEAD
                if room >= 0:
                    out.append(field)
                continue
            indexed_only = False
            if byte & 0xE0 == 0x20:  # dynamic table size update
                updates += 1
                if out or room != self._max_list or updates > 2:
                    raise HpackError("table size update not at the start of the block")
                size, pos = _integer(block, pos, 5)
                if size > self._limit:
                    raise HpackError("table size update above the limit")
                self._max_size = size
                self._evict(0)
                continue
            incremental = bool(byte & 0x40)
            index, pos = _integer(block, pos, 6 if incremental else 4)
            if index:
                name = self._get(index)[0]
            else:
                name, pos = _string(block, pos)
            value, pos = _string(block, pos)
            room -= len(name) + len(value) + _ENTRY_OVERHEAD
            if room >= 0:
                out.append((name, value))
            if incremental:
                self._add(name, value)
        if room < 0:
            raise HeaderListTooLarge(f"header list larger than {self._max_list} bytes")
        if indexed_only:
            if len(self._cache) >= _CACHE_LIMIT:
                self._cache.clear()
            self._cache[bytes(block)] = out
        return out

    def _get(self, index: int) -> tuple[str, str]:
        if 0 < index <= len(_STATIC):
            return _STATIC[index - 1]
        dynamic = index - len(_STATIC) - 1
        if 0 <= dynamic < len(self._entries):
            return self._entries[dynamic]
        raise HpackError(f"header index {index} out of range")

    def _add(self, name: str, value: str) -> None:
        self._cache.clear()  # indices now mean other entries
        size = len(name) + len(value) + _ENTRY_OVERHEAD
        self._evict(size)
        if size <= self._max_size:
            self._entries.appendleft((name, value))
            self._size += size

    def _evict(self, room: int) -> None:
        entries = self._entries
        while entries and self._size + room > self._max_size:
            name, value = entries.pop()
            self._size -= len(name) + len(value) + _ENTRY_OVERHEAD
            self._cache.clear()


def _encode_integer(value: int, prefix_bits: int) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((value,))
    out = bytearray((limit,))
    value -= limit
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode(headers: Sequence[tuple[bytes, bytes]]) -> bytes:
    """A header block of literals "without indexing" (RFC 7541 6.2.2), ``:status 200``
    as its static-table index: no dynamic table, so no encoder state."""
    out = bytearray()
    for name, value in headers:
        if name == b":status" and value == b"200":
            out.append(0x88)
            continue
        out += b"\x00" + _encode_integer(len(name), 7) + name
        out += _encode_integer(len(value), 7) + value
    return bytes(out)
