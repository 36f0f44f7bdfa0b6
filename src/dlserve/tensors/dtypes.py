"""The one table of tensor data types.

Every place that needs to translate a data type (wire name, config name,
numpy dtype, DLPack code, element size) looks it up here.

BF16 has no numpy dtype: its elements are carried as ``uint16`` bit patterns
on the host (``numpy_storage``), and DLPack exports it as ``kDLBfloat``.
BYTES elements have no fixed size: on the wire each element is a 4-byte
little-endian length followed by its bytes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

# DLPack type codes (dlpack.h, DLDataTypeCode).
DL_INT: Final = 0
DL_UINT: Final = 1
DL_FLOAT: Final = 2
DL_BFLOAT: Final = 4
DL_BOOL: Final = 6


@dataclass(frozen=True, slots=True)
class DType:
    """One data type as every layer names it."""

    wire: str  # KServe v2 / Triton wire name: "FP32"
    config: str  # model_config.proto DataType name: "TYPE_FP32"
    numpy: np.dtype[np.generic] | None  # None for BF16 (no numpy type)
    numpy_storage: np.dtype[np.generic]  # dtype used to hold the bytes on the host
    itemsize: int  # bytes per element; 0 for BYTES (variable)
    dl_code: int  # DLPack type code; -1 where DLPack has none (BYTES)
    dl_bits: int
    config_code: int  # model_config.proto DataType enum value (pb_utils.TYPE_*)
    is_bytes: bool = False  # BYTES (TYPE_STRING): variable-size elements; asked per tensor


def _d(
    wire: str, config: str, np_name: str | None, storage: str, size: int, code: int, bits: int
) -> DType:
    numpy_dtype = np.dtype(np_name) if np_name is not None else None
    config_code = _CONFIG_CODES.index(config)
    return DType(wire, config, numpy_dtype, np.dtype(storage), size, code, bits, config_code,
                 wire == "BYTES")  # fmt: skip


# model_config.proto's DataType enum, in value order (TYPE_INVALID = 0).
_CONFIG_CODES: Final = (
    "TYPE_INVALID", "TYPE_BOOL", "TYPE_UINT8", "TYPE_UINT16", "TYPE_UINT32", "TYPE_UINT64",
    "TYPE_INT8", "TYPE_INT16", "TYPE_INT32", "TYPE_INT64", "TYPE_FP16", "TYPE_FP32",
    "TYPE_FP64", "TYPE_STRING", "TYPE_BF16",
)  # fmt: skip


ALL: Final[tuple[DType, ...]] = (
    _d("BOOL", "TYPE_BOOL", "bool", "bool", 1, DL_BOOL, 8),
    _d("UINT8", "TYPE_UINT8", "uint8", "uint8", 1, DL_UINT, 8),
    _d("UINT16", "TYPE_UINT16", "uint16", "uint16", 2, DL_UINT, 16),
    _d("UINT32", "TYPE_UINT32", "uint32", "uint32", 4, DL_UINT, 32),
    _d("UINT64", "TYPE_UINT64", "uint64", "uint64", 8, DL_UINT, 64),
    _d("INT8", "TYPE_INT8", "int8", "int8", 1, DL_INT, 8),
    _d("INT16", "TYPE_INT16", "int16", "int16", 2, DL_INT, 16),
    _d("INT32", "TYPE_INT32", "int32", "int32", 4, DL_INT, 32),
    _d("INT64", "TYPE_INT64", "int64", "int64", 8, DL_INT, 64),
    _d("FP16", "TYPE_FP16", "float16", "float16", 2, DL_FLOAT, 16),
    _d("FP32", "TYPE_FP32", "float32", "float32", 4, DL_FLOAT, 32),
    _d("FP64", "TYPE_FP64", "float64", "float64", 8, DL_FLOAT, 64),
    _d("BF16", "TYPE_BF16", None, "uint16", 2, DL_BFLOAT, 16),
    _d("BYTES", "TYPE_STRING", "object", "object", 0, -1, 0),
)

BY_WIRE: Final[dict[str, DType]] = {d.wire: d for d in ALL}
BY_CONFIG: Final[dict[str, DType]] = {d.config: d for d in ALL}
BY_CONFIG_CODE: Final[dict[int, DType]] = {d.config_code: d for d in ALL}
BY_DLPACK: Final[dict[tuple[int, int], DType]] = {
    (d.dl_code, d.dl_bits): d for d in ALL if d.dl_code >= 0
}
_BY_NUMPY: Final[dict[np.dtype[np.generic], DType]] = {
    d.numpy: d for d in ALL if d.numpy is not None
}


def from_wire(name: str) -> DType | None:
    return BY_WIRE.get(name)


def from_config(name: str) -> DType | None:
    return BY_CONFIG.get(name)


def from_numpy(dtype: npt.DTypeLike) -> DType | None:
    """The DType of a numpy dtype; any bytes/str/object dtype is BYTES."""
    if isinstance(dtype, np.dtype):
        found = _BY_NUMPY.get(dtype)
        if found is not None:
            return found
    np_dtype = np.dtype(dtype)
    if np_dtype.kind in ("O", "S", "U"):
        return BY_WIRE["BYTES"]
    return _BY_NUMPY.get(np_dtype.newbyteorder("=") if np_dtype.byteorder == ">" else np_dtype)


# --- BYTES (de)serialization: 4-byte little-endian length, then the bytes ---------------

_LEN = struct.Struct("<I")


def serialize_bytes(array: npt.NDArray[np.generic]) -> bytes:
    """Serialize an array of bytes/str/objects into Triton's BYTES wire form (C order)."""
    parts: list[bytes] = []
    for item in np.asarray(array, dtype=object).ravel(order="C"):
        if isinstance(item, bytes):
            raw = item
        elif isinstance(item, str):
            raw = item.encode("utf-8")
        else:
            raw = str(item).encode("utf-8")
        parts.append(_LEN.pack(len(raw)))
        parts.append(raw)
    return b"".join(parts)


def deserialize_bytes(buffer: bytes | bytearray | memoryview) -> npt.NDArray[np.object_]:
    """Parse Triton's BYTES wire form into a flat object array of ``bytes``.

    Raises ValueError when an element's length runs past the end of the buffer.
    """
    view = memoryview(buffer).cast("B")
    items: list[bytes] = []
    offset = 0
    end = len(view)
    while offset < end:
        if offset + 4 > end:
            raise ValueError("BYTES tensor is truncated: incomplete element length")
        (length,) = _LEN.unpack_from(view, offset)
        offset += 4
        if offset + length > end:
            raise ValueError("BYTES tensor is truncated: element runs past the end of the data")
        items.append(bytes(view[offset : offset + length]))
        offset += length
    out = np.empty(len(items), dtype=object)
    out[:] = items
    return out


def byte_size(dtype: DType, shape: tuple[int, ...] | list[int]) -> int:
    """Bytes a fixed-size tensor of this shape holds (not valid for BYTES)."""
    count = 1
    for dim in shape:
        count *= dim
    return count * dtype.itemsize
