"""DLPack in pure Python and ctypes: export memory as capsules, import anyone's capsules.

No torch or cupy is needed. The structures follow ``dlpack.h``::

    DLDevice                 {int32 device_type, int32 device_id}
    DLDataType               {uint8 code, uint8 bits, uint16 lanes}
    DLTensor                 {void* data, DLDevice device, int32 ndim, DLDataType dtype,
                              int64* shape, int64* strides, uint64 byte_offset}
    DLManagedTensor          {DLTensor dl_tensor, void* manager_ctx, void (*deleter)(self*)}
    DLManagedTensorVersioned {DLPackVersion version{uint32 major, minor}, void* manager_ctx,
                              void (*deleter)(self*), uint64 flags, DLTensor dl_tensor}

Lifetimes:

- Export: numpy builds the DLManagedTensor (over a private array of same-sized unsigned
  ints whose base owns ``owner``), then its device and dtype fields are set to the truth;
  a host array of a type numpy exports as dlserve does is exported by numpy as it is.
  numpy's deleter and capsule destructor are C functions: they take the GIL from any
  thread and keep an exception that is being raised intact. A ctypes callback cannot do
  the latter: a capsule freed while an exception propagates (e.g. an argument of a
  failing ``torch.from_dlpack``) would enter Python with the error set and crash.
- Import: the capsule is renamed ``used_dltensor`` (the protocol's "consumed" mark) and a
  ``_ProducerRef`` takes over the producer's memory; it calls the producer's deleter exactly
  once, when it is garbage-collected (or ``release()``-d).
"""

from __future__ import annotations

import ctypes
import datetime
import struct
import threading
from collections.abc import Callable
from typing import Any, Final, NamedTuple

import numpy as np
import numpy.typing as npt

from dlserve.tensors import dtypes
from dlserve.tensors.dtypes import DType

# DLDeviceType values (dlpack.h).
CPU: Final = 1
CUDA: Final = 2
CUDA_HOST: Final = 3

_HOST_DEVICES: Final = (CPU, CUDA_HOST)
_READ_ONLY_FLAG: Final = 1 << 0  # DLPACK_FLAG_BITMASK_READ_ONLY
_SUPPORTED_MAJOR: Final = 1
_MAX_VERSION: Final = (1, 0)

_DL_CODE_NAMES: Final = {
    0: "int",
    1: "uint",
    2: "float",
    3: "handle",
    4: "bfloat",
    5: "complex",
    6: "bool",
}


def _pinned(name: bytes) -> bytes:
    """A capsule keeps a pointer to its name: keep the bytes alive for the whole process."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(name))
    return name


_NAME: Final = b"dltensor"
_VERSIONED_NAME: Final = b"dltensor_versioned"
_USED_NAME: Final = _pinned(b"used_dltensor")
_USED_VERSIONED_NAME: Final = _pinned(b"used_dltensor_versioned")
_CONSUME_LOCK: Final = threading.Lock()  # check-and-rename of a capsule is one step


class DLTensorInfo(NamedTuple):
    """What a DLTensor describes, read out of the producer's struct (a named tuple: made
    for every tensor that crosses the model boundary, it costs a third of a dataclass)."""

    ptr: int  # data pointer + byte_offset
    shape: tuple[int, ...]
    strides: tuple[int, ...] | None  # in elements; None = compact C order
    dtype: DType
    device_type: int
    device_id: int
    readonly: bool


# --- dlpack.h structures ----------------------------------------------------------------
# Read and written with ``struct`` over one copy of their bytes (``ctypes.string_at``): a
# ctypes.Structure builds an object per field access, ten times the cost per tensor.

# DLTensor: data, device {type, id}, ndim, dtype {code, bits, lanes}, shape*, strides*,
# byte_offset; 48 bytes.
_DL_TENSOR: Final = struct.Struct("<QiiiBBHQQQ")
# DLManagedTensor: DLTensor, manager_ctx, deleter.
_MANAGED: Final = struct.Struct(_DL_TENSOR.format + "QQ")
# DLManagedTensorVersioned: version {major, minor}, manager_ctx, deleter, flags, DLTensor.
_VERSIONED: Final = struct.Struct("<IIQQQ" + _DL_TENSOR.format[1:])
_HEAD: Final = struct.Struct("<QiiiBBH")  # DLTensor's first 24 bytes: data to dtype
_INT64S: Final = [struct.Struct(f"<{n}q") for n in range(33)]  # shapes and strides by ndim


# --- the PyCapsule C API ----------------------------------------------------------------

_api = ctypes.pythonapi
_capsule_is_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_IsValid", _api)
)
_capsule_get_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", _api)
)
_capsule_set_name = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_SetName", _api)
)
_capsule_get_name = ctypes.PYFUNCTYPE(ctypes.c_char_p, ctypes.py_object)(
    ("PyCapsule_GetName", _api)
)
_CAPSULE_TYPE: Final[type] = type(datetime.datetime_CAPI)

# A producer's deleter, called with the GIL held as numpy and torch do.
_DELETER_FN = ctypes.PYFUNCTYPE(None, ctypes.c_void_p)


# --- export -----------------------------------------------------------------------------


class _Memory:
    """Presents memory to numpy as an array interface and, as the array's base, owns it."""

    __slots__ = ("__array_interface__", "owner")

    def __init__(
        self,
        ptr: int,
        shape: tuple[int, ...],
        byte_strides: tuple[int, ...] | None,
        storage: np.dtype[Any],
        readonly: bool,
        owner: object,
    ) -> None:
        self.__array_interface__ = {
            "version": 3,
            "data": (ptr, readonly),
            "shape": shape,
            "strides": byte_strides,
            "typestr": storage.str,
        }
        self.owner = owner


_CARRIERS: Final = {size: np.dtype(f"u{size}") for size in (1, 2, 4, 8)}


def compact_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Strides, in elements, of a compact C-order tensor of this shape."""
    strides = [1] * len(shape)
    for axis in range(len(shape) - 2, -1, -1):
        strides[axis] = strides[axis + 1] * max(shape[axis + 1], 1)
    return tuple(strides)


def _check_exportable(
    dtype: DType, shape: tuple[int, ...], strides: tuple[int, ...] | None
) -> None:
    if dtype.dl_code < 0:
        raise ValueError(f"data type {dtype.wire} has no DLPack representation")
    if shape and min(shape) < 0:
        raise ValueError(f"negative dimension in shape {shape}")
    if strides is not None and len(strides) != len(shape):
        raise ValueError(f"strides {strides} do not match shape {shape}")


def export_capsule(
    ptr: int,
    shape: tuple[int, ...],
    dtype: DType,
    device_type: int,
    device_id: int,
    owner: object,
    strides: tuple[int, ...] | None = None,
) -> object:
    """A legacy "dltensor" capsule over memory at ``ptr``; ``owner`` lives until it is freed.

    ``strides`` are in elements (None: compact C order); the struct always carries them.
    The memory is never read here, so ``ptr`` may be a device pointer.
    """
    _check_exportable(dtype, shape, strides)
    # 1. A private numpy array of same-sized unsigned ints over the memory, based on owner.
    carrier_dtype = _CARRIERS.get(dtype.itemsize) or np.dtype(f"u{dtype.itemsize}")
    byte_strides = None if strides is None else tuple(s * dtype.itemsize for s in strides)
    memory = _Memory(ptr, shape, byte_strides, carrier_dtype, False, owner)
    # 2. numpy builds the DLManagedTensor, its C deleter and its capsule destructor.
    capsule: object = np.asarray(memory).__dlpack__()
    # 3. Say what the memory really is: where it lives and its element type (ndim, between
    #    them, as numpy wrote it).
    head = _HEAD.pack(ptr, device_type, device_id, len(shape), dtype.dl_code, dtype.dl_bits, 1)
    ctypes.memmove(_capsule_get_pointer(capsule, _NAME), head, _HEAD.size)
    return capsule


def capsule_from_array(array: npt.NDArray[Any], dtype: DType | None = None) -> object:
    """Export a host numpy array (any strides) as a capsule that keeps the array alive.

    ``dtype`` overrides the array's own type (BF16 held as uint16). Read-only arrays are
    refused: a legacy capsule cannot tell the consumer not to write.
    """
    dl_dtype = dtype if dtype is not None else dtypes.from_numpy(array.dtype)
    if dl_dtype is None or dl_dtype.dl_code < 0:
        raise ValueError(f"numpy dtype {array.dtype} has no DLPack representation")
    itemsize = array.dtype.itemsize
    if itemsize != dl_dtype.itemsize or not array.dtype.isnative:
        raise ValueError(f"numpy dtype {array.dtype.str} cannot be exported as {dl_dtype.wire}")
    if not array.flags.writeable:
        raise ValueError("cannot export a read-only array as a (legacy) DLPack capsule")
    strides = None
    if not array.flags.c_contiguous:
        if any(stride % itemsize for stride in array.strides):
            raise ValueError(f"strides {array.strides} are not multiples of {itemsize} bytes")
        strides = tuple(stride // itemsize for stride in array.strides)
    if dl_dtype.dl_code in _NUMPY_CODES and array.dtype == dl_dtype.numpy:
        return array.__dlpack__()  # numpy's own: the same fields, at a fifth of the cost
    ptr = int(array.__array_interface__["data"][0])
    return export_capsule(ptr, tuple(array.shape), dl_dtype, CPU, 0, array, strides)


# The types numpy exports as dlserve would (numpy < 1.25 exports no bool; BF16 is uint16).
_NUMPY_CODES: Final = (dtypes.DL_INT, dtypes.DL_UINT, dtypes.DL_FLOAT)


# --- import -----------------------------------------------------------------------------


class _ProducerRef:
    """Owns one consumed DLManagedTensor(Versioned): calls its deleter exactly once."""

    __slots__ = ("__weakref__", "_pending")

    def __init__(self, managed: int, deleter: int) -> None:
        self._pending = [(managed, deleter)] if deleter else []

    def release(self) -> None:
        """Give the memory back to the producer now; later calls do nothing."""
        try:
            managed, deleter = self._pending.pop()  # atomic: one caller wins
        except IndexError:
            return
        _DELETER_FN(deleter)(managed)

    def __del__(self) -> None:
        self.release()


def _dtype_name(code: int, bits: int, lanes: int) -> str:
    name = f"{_DL_CODE_NAMES.get(code, f'code{code}_')}{bits}"
    return name if lanes == 1 else f"{name}x{lanes}"


def _read_dtype(code: int, bits: int, lanes: int) -> DType:
    found = dtypes.BY_DLPACK.get((code, bits)) if lanes == 1 else None
    if found is None:
        raise ValueError(f"unsupported DLPack data type {_dtype_name(code, bits, lanes)}")
    return found


def _read_int64s(address: int, count: int) -> tuple[int, ...] | None:
    if not address:
        return None if count else ()
    if count < len(_INT64S):
        return _INT64S[count].unpack(ctypes.string_at(address, 8 * count))
    return struct.unpack(f"<{count}q", ctypes.string_at(address, 8 * count))


_COMPACT: dict[tuple[int, ...], tuple[int, ...]] = {}  # compact strides of shapes seen
_COMPACT_KEPT: Final = 256


def _is_compact(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether ``strides`` address ``shape`` as compact C order does (the strides of size-1
    dimensions do not matter). A model's tensors come in a few shapes: each one's compact
    strides are kept, so the usual answer is one comparison."""
    compact = _COMPACT.get(shape)
    if compact is None:
        if len(_COMPACT) >= _COMPACT_KEPT:
            _COMPACT.clear()
        compact = _COMPACT[shape] = compact_strides(shape)
    if strides == compact:
        return True
    if 0 in shape:
        return True
    expected = 1
    for dim, stride in zip(reversed(shape), reversed(strides), strict=True):
        if dim != 1 and stride != expected:
            return False
        expected *= dim
    return True


def _read_tensor(fields: tuple[int, ...], readonly: bool) -> DLTensorInfo:
    """A DLTensor's ten fields (``_DL_TENSOR``'s order) as a DLTensorInfo."""
    data, device_type, device_id, ndim, code, bits, lanes, shape_at, strides_at, offset = fields
    dtype = _read_dtype(code, bits, lanes)
    shape = _read_int64s(shape_at, ndim) if ndim >= 0 else None
    if shape is None:
        raise ValueError(f"malformed DLTensor: ndim={ndim}, shape pointer {shape_at or None}")
    strides = _read_int64s(strides_at, ndim)
    if strides is not None and _is_compact(shape, strides):
        strides = None
    return DLTensorInfo(data + offset, shape, strides, dtype, device_type, device_id, readonly)


def _reports_cpu(obj: object) -> bool:
    device: Callable[[], tuple[int, int]] | None = getattr(obj, "__dlpack_device__", None)
    return device is not None and int(device()[0]) == CPU


def _request_capsule(obj: object, stream: int | None) -> object:
    """Ask a producer for a capsule: legacy first, versioned if only that can be given."""
    dlpack: Callable[..., object] | None = getattr(obj, "__dlpack__", None)
    if dlpack is None:
        raise TypeError(f"{type(obj).__name__} is neither a DLPack capsule nor has __dlpack__")
    kwargs = {} if stream is None or _reports_cpu(obj) else {"stream": stream}
    try:
        return dlpack(**kwargs)
    except BufferError as legacy_error:
        # e.g. numpy refuses read-only arrays as legacy capsules, which cannot say "read-only".
        try:
            return dlpack(max_version=_MAX_VERSION, **kwargs)
        except TypeError:
            raise legacy_error from None


def _consume_legacy(capsule: object) -> tuple[DLTensorInfo, object]:
    address = int(_capsule_get_pointer(capsule, _NAME))
    fields = _MANAGED.unpack(ctypes.string_at(address, _MANAGED.size))
    info = _read_tensor(fields[:10], readonly=False)
    _capsule_set_name(capsule, _USED_NAME)
    return info, _ProducerRef(address, fields[11])


def _consume_versioned(capsule: object) -> tuple[DLTensorInfo, object]:
    address = int(_capsule_get_pointer(capsule, _VERSIONED_NAME))
    fields = _VERSIONED.unpack(ctypes.string_at(address, _VERSIONED.size))
    major, minor, _, deleter, flags = fields[:5]
    if major != _SUPPORTED_MAJOR:
        raise ValueError(f"unsupported DLPack version {major}.{minor}")
    info = _read_tensor(fields[5:], bool(flags & _READ_ONLY_FLAG))
    _capsule_set_name(capsule, _USED_VERSIONED_NAME)
    return info, _ProducerRef(address, deleter)


def import_capsule(obj: object, stream: int | None = None) -> tuple[DLTensorInfo, object]:
    """Consume a DLPack capsule (or an object with ``__dlpack__``).

    Returns the tensor's description and a keepalive object that owns the producer's
    memory: when it is garbage-collected the producer's deleter runs, exactly once.
    A capsule that cannot be imported is left unconsumed (its producer still frees it).
    """
    capsule = obj if isinstance(obj, _CAPSULE_TYPE) else _request_capsule(obj, stream)
    if not isinstance(capsule, _CAPSULE_TYPE):
        raise TypeError(f"__dlpack__ returned {type(capsule).__name__}, not a capsule")
    with _CONSUME_LOCK:
        if _capsule_is_valid(capsule, _NAME):
            return _consume_legacy(capsule)
        if _capsule_is_valid(capsule, _VERSIONED_NAME):
            return _consume_versioned(capsule)
    name = _capsule_get_name(capsule)
    if name in (_USED_NAME, _USED_VERSIONED_NAME):
        raise ValueError("DLPack capsule was already consumed")
    raise ValueError(f"not a DLPack capsule: capsule named {name!r}")


# --- host views -------------------------------------------------------------------------


def host_array(info: DLTensorInfo, keepalive: object) -> npt.NDArray[Any]:
    """A numpy view (no copy) of a host tensor that keeps ``keepalive`` alive.

    BF16 comes back as its uint16 storage. Read-only tensors give read-only arrays.
    """
    if info.device_type not in _HOST_DEVICES:
        raise ValueError(f"DLPack device type {info.device_type} is not host memory")
    if not info.ptr and 0 not in info.shape:
        raise ValueError("DLPack tensor has a NULL data pointer")
    storage = info.dtype.numpy_storage
    byte_strides = None
    if info.strides is not None:
        byte_strides = tuple(stride * storage.itemsize for stride in info.strides)
    memory = _Memory(info.ptr, info.shape, byte_strides, storage, info.readonly, keepalive)
    return np.asarray(memory)
