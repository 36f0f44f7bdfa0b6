"""Framing: ``[u32 header length][u32 payload length][msgpack header][payload]``.

The header is one message of :mod:`dlserve.ipc.messages`; the payload holds the
bytes of tensors that travel inline (TensorRef.where == PAYLOAD), back to back.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Final, Generic, TypeVar

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


def encode_sized(
    message: messages._Msg, payload: Sequence[bytes | memoryview] = ()
) -> tuple[list[bytes | memoryview], int]:
    """The buffers of one frame, and its size in bytes."""
    header = _encoder.encode(message)
    payload_len = 0
    for part in payload:
        payload_len += part.nbytes if type(part) is memoryview else len(part)
    frame = [PREFIX.pack(len(header), payload_len), header, *payload]
    return frame, PREFIX_SIZE + len(header) + payload_len


class Decoder(Generic[T]):
    """Decodes one direction's headers."""

    def __init__(self, union: type[T]) -> None:
        self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(union)

    def decode(self, header: bytes | memoryview) -> T:
        return self._decoder.decode(header)


to_worker: Final[Decoder[messages.ServerToWorker]] = Decoder(messages.ServerToWorker)  # type: ignore[arg-type]
to_server: Final[Decoder[messages.WorkerToServer]] = Decoder(messages.WorkerToServer)  # type: ignore[arg-type]
