"""DLPack export and import, checked against numpy and torch as real producers/consumers."""

from __future__ import annotations

import ctypes
import gc
import sys
import threading
import weakref
from typing import Any

import numpy as np
import pytest

from dlserve.tensors import dlpack, dtypes

BF16 = dtypes.BY_WIRE["BF16"]
FP32 = dtypes.BY_WIRE["FP32"]
FIXED_NUMPY_DTYPES = [d for d in dtypes.ALL if d.wire not in ("BF16", "BYTES")]
BF16_VALUES = [1.0, -2.5, 3.140625, 0.0]


def data_ptr(array: np.ndarray[Any, Any]) -> int:
    return int(array.__array_interface__["data"][0])


def bf16_bits(values: list[float]) -> np.ndarray[Any, Any]:
    """bfloat16 bit patterns of values that bfloat16 holds exactly."""
    return (np.array(values, np.float32).view(np.uint32) >> 16).astype(np.uint16)


class Owner:
    """Something to watch through a weakref."""


class CapsuleProducer:
    """Hands out one prepared capsule through the Python DLPack protocol."""

    def __init__(self, capsule: object, device: tuple[int, int] = (dlpack.CPU, 0)) -> None:
        self.capsule = capsule
        self.device = device
        self.requests: list[dict[str, Any]] = []

    def __dlpack__(self, **kwargs: Any) -> object:
        self.requests.append(kwargs)
        return self.capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.device


def numpy_from(producer: CapsuleProducer) -> np.ndarray[Any, Any]:
    """numpy as the consumer (its stubs only know producers with numpy's exact signature)."""
    return np.from_dlpack(producer)  # type: ignore[arg-type]


# --- a producer written independently against dlpack.h, counting its deleter calls -------


class _Device(ctypes.Structure):
    _fields_ = (("type", ctypes.c_int32), ("id", ctypes.c_int32))


class _DataType(ctypes.Structure):
    _fields_ = (("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16))


class _Tensor(ctypes.Structure):
    _fields_ = (
        ("data", ctypes.c_void_p),
        ("device", _Device),
        ("ndim", ctypes.c_int32),
        ("dtype", _DataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    )


_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class _Managed(ctypes.Structure):
    _fields_ = (("dl_tensor", _Tensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER))


_capsule_new = ctypes.PYFUNCTYPE(
    ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p
)(("PyCapsule_New", ctypes.pythonapi))


class CountingProducer:
    """A legacy capsule over ``values`` (whose deleter only counts), with knobs to break it."""

    def __init__(self, values: np.ndarray[Any, Any], *, lanes: int = 1, byte_offset: int = 0):
        self.values = values
        self.calls = 0
        self.threads: list[int] = []
        self._deleter = _DELETER(self._on_delete)
        self._shape = (ctypes.c_int64 * values.ndim)(*values.shape)
        tensor = _Tensor(
            data=data_ptr(values) - byte_offset,
            device=_Device(dlpack.CPU, 0),
            ndim=values.ndim,
            dtype=_DataType(2, 8 * values.itemsize, lanes),
            shape=self._shape,
            byte_offset=byte_offset,
        )
        self._managed = _Managed(dl_tensor=tensor, deleter=self._deleter)
        self.capsule = _capsule_new(ctypes.addressof(self._managed), b"dltensor", None)

    def _on_delete(self, address: int | None) -> None:
        assert address == ctypes.addressof(self._managed)
        self.calls += 1
        self.threads.append(threading.get_ident())


# --- export to numpy -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FIXED_NUMPY_DTYPES, ids=lambda d: d.wire)
def test_numpy_round_trip_shares_memory(dtype: dtypes.DType) -> None:
    assert dtype.numpy is not None
    source = (np.arange(6) % 2 if dtype.wire == "BOOL" else np.arange(6)).astype(dtype.numpy)
    source = source.reshape(2, 3)
    result = numpy_from(CapsuleProducer(dlpack.capsule_from_array(source)))
    assert result.dtype == dtype.numpy
    assert data_ptr(result) == data_ptr(source)
    np.testing.assert_array_equal(result, source)
    source[0, 0] = 1  # numpy makes arrays from legacy capsules read-only, so write the source
    assert result[0, 0] == 1
    # and back through dlserve's own import, which gives a writable view
    view = dlpack.host_array(*dlpack.import_capsule(dlpack.capsule_from_array(source)))
    view[1, 2] = 0
    assert source[1, 2] == 0 and result[1, 2] == 0


@pytest.mark.parametrize(
    "view", [lambda a: a[:, ::2], lambda a: a.T, lambda a: a[::-1], lambda a: a[1, 1, ...]]
)
def test_numpy_round_trip_any_strides(view: Any) -> None:
    source = view(np.arange(24, dtype=np.float32).reshape(4, 6))
    result = numpy_from(CapsuleProducer(dlpack.capsule_from_array(source)))
    assert data_ptr(result) == data_ptr(source)
    assert result.strides == source.strides
    np.testing.assert_array_equal(result, source)


def test_export_device_memory_is_described_not_touched() -> None:
    capsule = dlpack.export_capsule(0xDEAD0000, (4, 2), FP32, dlpack.CUDA, 3, Owner(), (1, 4))
    info, keepalive = dlpack.import_capsule(capsule)
    assert (info.ptr, info.shape, info.strides) == (0xDEAD0000, (4, 2), (1, 4))
    assert (info.dtype, info.device_type, info.device_id) == (FP32, dlpack.CUDA, 3)
    with pytest.raises(ValueError, match="not host memory"):
        dlpack.host_array(info, keepalive)


# --- lifetimes -----------------------------------------------------------------------------


def test_owner_lives_until_numpy_consumer_is_gone() -> None:
    owner = Owner()
    watch = weakref.ref(owner)
    memory = np.arange(4, dtype=np.int32)
    capsule = dlpack.export_capsule(data_ptr(memory), (4,), dtypes.BY_WIRE["INT32"], 1, 0, owner)
    consumer = numpy_from(CapsuleProducer(capsule))
    del owner, capsule
    gc.collect()
    assert watch() is not None
    del consumer
    gc.collect()
    assert watch() is None


def test_owner_of_unconsumed_capsule_is_freed_with_the_capsule() -> None:
    owner = Owner()
    watch = weakref.ref(owner)
    capsule = dlpack.export_capsule(0, (0,), FP32, dlpack.CPU, 0, owner)
    del owner
    gc.collect()
    assert watch() is not None
    del capsule
    gc.collect()
    assert watch() is None


def test_capsule_freed_while_an_exception_propagates_keeps_the_exception() -> None:
    source = np.arange(3.0)
    watch = weakref.ref(source)
    with pytest.raises(ZeroDivisionError):
        # the capsule is freed while ZeroDivisionError is being raised
        [dlpack.capsule_from_array(source), 1 / 0]
    del source
    gc.collect()
    assert watch() is None


def test_keepalive_calls_the_deleter_exactly_once() -> None:
    producer = CountingProducer(np.arange(4, dtype=np.float32))
    info, keepalive = dlpack.import_capsule(producer.capsule)
    view = dlpack.host_array(info, keepalive)
    del keepalive
    gc.collect()
    assert producer.calls == 0
    np.testing.assert_array_equal(view, [0, 1, 2, 3])
    del view
    gc.collect()
    assert producer.calls == 1


def test_keepalive_released_on_another_thread_calls_the_deleter_once() -> None:
    producer = CountingProducer(np.arange(4, dtype=np.float64))
    holder = [dlpack.import_capsule(producer.capsule)[1]]
    worker = threading.Thread(target=holder.clear)
    worker.start()
    worker.join()
    gc.collect()
    assert producer.calls == 1
    assert producer.threads == [worker.ident]


def test_numpy_producer_deleter_runs_once() -> None:
    source = np.arange(5, dtype=np.int16)
    baseline = sys.getrefcount(source)
    info, keepalive = dlpack.import_capsule(source)
    view = dlpack.host_array(info, keepalive)
    assert sys.getrefcount(source) == baseline + 1  # held by numpy's DLManagedTensor
    assert data_ptr(view) == data_ptr(source)
    del info, keepalive, view
    gc.collect()
    assert sys.getrefcount(source) == baseline


def test_host_array_keeps_the_producer_alive() -> None:
    source = np.arange(6, dtype=np.uint8).reshape(2, 3)
    watch = weakref.ref(source)
    view = dlpack.host_array(*dlpack.import_capsule(source))
    del source
    gc.collect()
    assert watch() is not None
    view[0, 0] = 7
    assert watch()[0, 0] == 7  # type: ignore[index]
    del view
    gc.collect()
    assert watch() is None


# --- import ----------------------------------------------------------------------------------


def test_import_strided_and_compact_numpy_arrays() -> None:
    base = np.arange(24, dtype=np.int64).reshape(4, 6)
    info, _ = dlpack.import_capsule(base)
    assert info.strides is None and info.shape == (4, 6) and not info.readonly
    sliced = base[1:, ::3]
    info, keepalive = dlpack.import_capsule(sliced)
    assert info.strides == (6, 3) and info.ptr == data_ptr(sliced)
    np.testing.assert_array_equal(dlpack.host_array(info, keepalive), sliced)


def test_import_tells_compact_from_strided_arrays_of_one_shape() -> None:
    """The compact strides kept per shape make no strided array of that shape compact;
    the strides of size-1 dimensions, and of empty tensors, do not matter."""
    base = np.arange(48, dtype=np.int32).reshape(4, 12)
    compact, _ = dlpack.import_capsule(base[:, :6].copy())
    strided, _ = dlpack.import_capsule(base[:, ::2])
    assert compact.strides is None and strided.shape == compact.shape == (4, 6)
    assert strided.strides == (12, 2)
    one_row = np.lib.stride_tricks.as_strided(base, shape=(1, 12), strides=(400, 4))
    assert dlpack.import_capsule(one_row)[0].strides is None
    empty = np.lib.stride_tricks.as_strided(base, shape=(0, 12), strides=(4, 8))
    assert dlpack.import_capsule(empty)[0].strides is None


def test_import_byte_offset() -> None:
    values = np.arange(8, dtype=np.float32)[2:]
    producer = CountingProducer(values, byte_offset=8)
    info, keepalive = dlpack.import_capsule(producer.capsule)
    assert info.ptr == data_ptr(values)
    np.testing.assert_array_equal(dlpack.host_array(info, keepalive), values)


def test_import_versioned_read_only_capsules() -> None:
    source = np.arange(4, dtype=np.float32)
    source.flags.writeable = False
    versioned = source.__dlpack__(max_version=(1, 0))
    for producer in (versioned, source):  # a capsule, and numpy's legacy refusal then retry
        info, keepalive = dlpack.import_capsule(producer)
        assert info.readonly
        view = dlpack.host_array(info, keepalive)
        assert not view.flags.writeable
        assert data_ptr(view) == data_ptr(source)
    assert "used_dltensor_versioned" in repr(versioned)


def test_stream_is_passed_only_to_non_cpu_producers() -> None:
    on_gpu = CapsuleProducer(dlpack.capsule_from_array(np.zeros(2)), device=(dlpack.CUDA, 0))
    dlpack.import_capsule(on_gpu, stream=7)
    on_cpu = CapsuleProducer(dlpack.capsule_from_array(np.zeros(2)))
    dlpack.import_capsule(on_cpu, stream=7)
    no_stream = CapsuleProducer(dlpack.capsule_from_array(np.zeros(2)), device=(dlpack.CUDA, 0))
    dlpack.import_capsule(no_stream)
    assert (on_gpu.requests, on_cpu.requests, no_stream.requests) == ([{"stream": 7}], [{}], [{}])


# --- errors ----------------------------------------------------------------------------------


def test_unsupported_dtype_is_refused_and_left_unconsumed() -> None:
    capsule = np.zeros(3, np.complex64).__dlpack__()
    with pytest.raises(ValueError, match="complex64"):
        dlpack.import_capsule(capsule)
    assert '"dltensor"' in repr(capsule)


def test_vector_lanes_are_refused() -> None:
    producer = CountingProducer(np.zeros(4, np.float32), lanes=4)
    with pytest.raises(ValueError, match="float32x4"):
        dlpack.import_capsule(producer.capsule)
    assert producer.calls == 0


def test_capsule_consumed_twice() -> None:
    capsule = dlpack.capsule_from_array(np.zeros(3))
    dlpack.import_capsule(capsule)
    with pytest.raises(ValueError, match="already consumed"):
        dlpack.import_capsule(capsule)


def test_not_a_dlpack_object() -> None:
    with pytest.raises(TypeError, match="__dlpack__"):
        dlpack.import_capsule(object())


@pytest.mark.parametrize(
    ("array", "message"),
    [
        (np.array(["a"], dtype=object), "no DLPack representation"),
        (np.zeros(2, np.dtype(">i4")), "cannot be exported"),
        (np.ndarray((2,), np.int32, buffer=bytearray(16), strides=(6,)), "multiples"),
        (np.broadcast_to(np.zeros(1), (3,)), "read-only"),
    ],
)
def test_capsule_from_array_refuses(array: np.ndarray[Any, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dlpack.capsule_from_array(array)


# --- torch as a real consumer and producer -------------------------------------------------


@pytest.mark.parametrize("wire", ["FP32", "INT64", "BOOL"])
def test_torch_consumes_exports_sharing_memory(wire: str) -> None:
    torch = pytest.importorskip("torch")
    dtype = dtypes.BY_WIRE[wire]
    assert dtype.numpy is not None
    source = (np.arange(6) % 2).astype(dtype.numpy).reshape(3, 2)
    tensor = torch.from_dlpack(dlpack.capsule_from_array(source))
    assert tensor.data_ptr() == data_ptr(source)
    assert tensor.tolist() == source.tolist()
    tensor[0, 0] = 1
    assert source[0, 0] == 1


def test_torch_consumes_bf16() -> None:
    torch = pytest.importorskip("torch")
    bits = bf16_bits(BF16_VALUES)
    tensor = torch.from_dlpack(dlpack.capsule_from_array(bits, BF16))
    assert tensor.dtype == torch.bfloat16
    assert tensor.data_ptr() == data_ptr(bits)
    assert tensor.tolist() == BF16_VALUES


def test_torch_consumer_freed_on_another_thread_frees_the_owner() -> None:
    torch = pytest.importorskip("torch")
    source = np.arange(4, dtype=np.float32)
    watch = weakref.ref(source)
    holder = [torch.from_dlpack(dlpack.capsule_from_array(source))]
    del source
    gc.collect()
    assert watch() is not None
    worker = threading.Thread(target=holder.clear)
    worker.start()
    worker.join()
    gc.collect()
    assert watch() is None


def test_import_torch_tensors() -> None:
    torch = pytest.importorskip("torch")
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    for tensor in (base, base[:, 1::2]):
        info, keepalive = dlpack.import_capsule(tensor)
        view = dlpack.host_array(info, keepalive)
        assert data_ptr(view) == tensor.data_ptr()
        np.testing.assert_array_equal(view, tensor.numpy())
    view[0, 0] = -1.0
    assert base[0, 1].item() == -1.0


def test_import_torch_bf16() -> None:
    torch = pytest.importorskip("torch")
    tensor = torch.tensor(BF16_VALUES, dtype=torch.bfloat16)
    info, keepalive = dlpack.import_capsule(tensor)
    assert info.dtype is BF16
    view = dlpack.host_array(info, keepalive)
    assert view.dtype == np.uint16 and data_ptr(view) == tensor.data_ptr()
    np.testing.assert_array_equal(view, bf16_bits(BF16_VALUES))
