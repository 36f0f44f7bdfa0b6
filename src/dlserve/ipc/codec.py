"""Framing: ``[u32 header length][u32 payload length][msgpack header][payload]``.

The header is one message of :mod:`dlserve.ipc.messages`; the payload holds the
bytes of tensors that travel inline (TensorRef.where == PAYLOAD), back to back.

A header that does not decode as a message of its direction is :class:`UnreadableFrame`,
not the end of the stream: the frame's length is known, so the next frame is read as
usual, and what could be read of the bad one (its kind, its request or call id, where
its outputs' bytes are) lets the receiver fail that one request and keep the rest. A
message that cannot be encoded (a value of a type its field does not take) is
:class:`UnencodableFrame`, raised before anything is written.
"""

from __future__ import annotations

import struct
import typing
from collections.abc import Sequence
from typing import Any, Final, Generic, TypeVar

import msgspec

from dlserve.ipc import messages

PREFIX: Final = struct.Struct("<II")
PREFIX_SIZE: Final = PREFIX.size
MAX_HEADER: Final = 64 * 1024 * 1024

_encoder = msgspec.msgpack.Encoder()

T = TypeVar("T")


def encode(
    message: messages._Msg, payload: Sequence[bytes | memoryview] = ()
) -> list[bytes | memoryview]:
    """The buffers of one frame, to be written in order (sendmsg / writelines)."""
    return encode_sized(message, payload)[0]


class UnencodableFrame(Exception):
    """``message`` holds a value its field's type does not take (nothing was written)."""

    def __init__(self, message: messages._Msg, cause: Exception) -> None:
        super().__init__(f"{type(message).__name__}: {cause}")
        self.message = message
        self.cause = str(cause)


def encode_sized(
    message: messages._Msg, payload: Sequence[bytes | memoryview] = ()
) -> tuple[list[bytes | memoryview], int]:
    """The buffers of one frame, and its size in bytes. Raises UnencodableFrame."""
    try:
        header = _encoder.encode(message)
    except (TypeError, ValueError, OverflowError, msgspec.EncodeError) as exc:
        raise UnencodableFrame(message, exc) from None
    payload_len = 0
    for part in payload:
        payload_len += part.nbytes if type(part) is memoryview else len(part)
    frame = [PREFIX.pack(len(header), payload_len), header, *payload]
    return frame, PREFIX_SIZE + len(header) + payload_len


class UnreadableFrame(Exception):
    """A frame whose header is not a message of its direction. The frame was consumed
    whole (the stream is still in step). ``kind``: the message type its tag names (None:
    not even that could be read); ``fields``: those of its fields that hold values of
    their types (a list of TensorRef keeps the placements of refs whose other fields are
    bad: their names are ""); ``payload``: the frame's payload."""

    def __init__(self, cause: str, kind: type[messages._Msg] | None, fields: dict[str, Any]):
        super().__init__(f"{kind.__name__ if kind is not None else 'unknown message'}: {cause}")
        self.cause = cause
        self.kind = kind
        self.fields = fields
        self.payload = memoryview(b"")

    @property
    def what(self) -> str:
        """ "a frame (InferDone) that cannot be read", for messages."""
        kind = f" ({self.kind.__name__})" if self.kind is not None else ""
        return f"a frame{kind} that cannot be read"

    @property
    def ident(self) -> int | None:
        """The frame's request id (``rid``) or call id (``call``), when it could be read."""
        for name in ("rid", "call"):
            value = self.fields.get(name)
            if type(value) is int:
                return value
        return None


class Decoder(Generic[T]):
    """Decodes one direction's headers."""

    def __init__(self, union: type[T]) -> None:
        self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(union)
        self._kinds: dict[object, type[messages._Msg]] = {
            kind.__struct_config__.tag: kind for kind in typing.get_args(union)
        }

    def decode(self, header: bytes | memoryview) -> T:
        """The message; raises UnreadableFrame when the header is not one of them."""
        try:
            return self._decoder.decode(header)
        except msgspec.DecodeError as exc:  # ValidationError too
            raise self._unreadable(bytes(header), str(exc)) from None

    def _unreadable(self, header: bytes, cause: str) -> UnreadableFrame:
        """Read leniently what a failed header holds: its tag, then field by field."""
        try:
            raw = msgspec.msgpack.decode(header)
        except msgspec.DecodeError:
            return UnreadableFrame(cause, None, {})
        if not isinstance(raw, list) or not raw or type(raw[0]) is not int:
            return UnreadableFrame(cause, None, {})
        kind = self._kinds.get(raw[0])
        if kind is None:
            return UnreadableFrame(cause, None, {})
        return UnreadableFrame(cause, kind, _fields(kind, raw[1:]))


def _fields(kind: type[messages._Msg], values: list[Any]) -> dict[str, Any]:
    """The fields of ``kind`` whose ``values`` (in order: array-like) have their types."""
    fields: dict[str, Any] = {}
    for field, value in zip(msgspec.structs.fields(kind), values, strict=False):
        try:
            fields[field.name] = msgspec.convert(value, field.type)
        except msgspec.ValidationError:
            if field.type == list[messages.TensorRef] and isinstance(value, list):
                fields[field.name] = [_placement(item) for item in value]
    return fields


class _Placement(msgspec.Struct, array_like=True, gc=False):
    """Where a TensorRef's bytes are, whatever its other fields hold."""

    name: Any
    datatype: Any
    shape: Any
    where: messages.Where
    offset: int
    nbytes: int
    region: int = 0
    key: Any = ""
    handle: Any = b""
    device: int = 0
    lend: int = 0


def _placement(item: object) -> messages.TensorRef:
    """A TensorRef that could not be read, kept for where its bytes are (its memory goes
    back to its owner); with no placement to read, one that names nothing (NOWHERE)."""
    try:
        return msgspec.convert(item, messages.TensorRef)
    except msgspec.ValidationError:
        pass
    try:
        at = msgspec.convert(item, _Placement)
    except msgspec.ValidationError:
        return messages.TensorRef("", "", [], messages.Where.NOWHERE, 0, 0)
    handle = at.handle if isinstance(at.handle, bytes) else b""
    return messages.TensorRef("", "", [], at.where, at.offset, at.nbytes, at.region, "",
                              handle, at.device, at.lend)  # fmt: skip


to_worker: Final[Decoder[messages.ServerToWorker]] = Decoder(messages.ServerToWorker)  # type: ignore[arg-type]
to_server: Final[Decoder[messages.WorkerToServer]] = Decoder(messages.WorkerToServer)  # type: ignore[arg-type]
