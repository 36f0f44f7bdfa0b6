"""pb_utils.Tensor: construction, views, DLPack in and out (numpy and torch as the peers)."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import numpy as np
import pytest

from dlserve import pb_utils as pb_utils
from dlserve.tensors import dlpack, dtypes

torch = pytest.importorskip("torch")

FIXED = [d for d in dtypes.ALL if d.numpy is not None and not d.is_bytes]
BF16 = dtypes.BY_WIRE["BF16"]


def data_ptr(array: np.ndarray[Any, Any]) -> int:
    return int(array.__array_interface__["data"][0])


@pytest.mark.parametrize("dtype", FIXED, ids=lambda d: d.wire)
def test_tensor_from_numpy_keeps_the_array(dtype: dtypes.DType) -> None:
    array = np.arange(6).astype(dtype.numpy).reshape(2, 3)
    tensor = pb_utils.Tensor("x", array)
    assert tensor.name() == "x"
    assert tensor.shape() == [2, 3]
    assert tensor.triton_dtype() == dtype.config_code
    assert tensor.is_cpu()
    assert tensor.as_numpy() is array  # no copy of a C-contiguous array


def test_non_contiguous_array_is_made_contiguous_as_in_triton() -> None:
    array = np.arange(12, dtype=np.float32).reshape(3, 4).T
    tensor = pb_utils.Tensor("x", array)
    assert tensor.as_numpy().flags.c_contiguous
    np.testing.assert_array_equal(tensor.as_numpy(), array)


@pytest.mark.parametrize(
    "data",
    [np.array([b"a", b"bc\x00"], dtype=np.object_), np.array([b"a", b"bc"]), np.array(["a", "bc"])],
    ids=["object", "bytes_", "str_"],
)
def test_bytes_tensors(data: np.ndarray[Any, Any]) -> None:
    tensor = pb_utils.Tensor("s", data)
    assert tensor.triton_dtype() == pb_utils.TYPE_STRING
    assert tensor.as_numpy().dtype == np.object_
    first = tensor.as_numpy()[0]
    assert (first if isinstance(first, bytes) else first.encode()) == b"a"


def test_empty_name_and_unsupported_dtype_are_refused() -> None:
    with pytest.raises(pb_utils.TritonModelException, match="Tensor name cannot be an empty"):
        pb_utils.Tensor("", np.zeros(1))
    with pytest.raises(pb_utils.TritonModelException, match="NumPy dtype is not supported"):
        pb_utils.Tensor("c", np.zeros(2, dtype=np.complex64))


def test_dtype_override_reinterprets_bf16_bits() -> None:
    bits = np.array([0x3F80, 0xC020], dtype=np.uint16)  # 1.0, -2.5
    tensor = pb_utils.Tensor("b", bits, "BF16")
    assert tensor.triton_dtype() == pb_utils.TYPE_BF16
    assert torch.from_dlpack(tensor).tolist() == [1.0, -2.5]
    with pytest.raises(pb_utils.TritonModelException, match="cannot hold BF16"):
        pb_utils.Tensor("b", np.zeros(2, np.float32), pb_utils.TYPE_BF16)


def test_bf16_as_numpy_is_refused_with_tritons_message() -> None:
    tensor = pb_utils.Tensor.from_dlpack("b", torch.ones(3, dtype=torch.bfloat16))
    with pytest.raises(pb_utils.TritonModelException, match="Tensor dtype is BF16"):
        tensor.as_numpy()


@pytest.mark.parametrize("dtype", [*FIXED, BF16], ids=lambda d: d.wire)
def test_to_dlpack_shares_memory_with_torch(dtype: dtypes.DType) -> None:
    storage = np.arange(4).astype(dtype.numpy_storage)
    tensor = pb_utils.Tensor._wrap("x", storage, dtype)
    consumer = torch.utils.dlpack.from_dlpack(tensor.to_dlpack())
    assert consumer.data_ptr() == data_ptr(storage)
    assert list(consumer.shape) == [4]


def test_writes_through_dlpack_are_seen_by_as_numpy() -> None:
    tensor = pb_utils.Tensor("x", np.zeros(4, dtype=np.float32))
    torch.from_dlpack(tensor).add_(5)  # the __dlpack__ protocol
    np.testing.assert_array_equal(tensor.as_numpy(), [5, 5, 5, 5])


def test_numpy_consumes_a_tensor_by_protocol() -> None:
    tensor = pb_utils.Tensor("x", np.arange(3, dtype=np.int64))
    assert tensor.__dlpack_device__() == (dlpack.CPU, 0)
    view = np.from_dlpack(tensor)  # type: ignore[call-overload]
    assert data_ptr(view) == data_ptr(tensor.as_numpy())


def test_bytes_tensor_has_no_dlpack() -> None:
    tensor = pb_utils.Tensor("s", np.array([b"x"], dtype=np.object_))
    with pytest.raises(pb_utils.TritonModelException, match="string tensors"):
        tensor.to_dlpack()


def test_from_dlpack_of_torch_shares_and_keeps_the_producer() -> None:
    producer = torch.arange(6, dtype=torch.float32)
    watch = weakref.ref(producer)
    tensor = pb_utils.Tensor.from_dlpack("y", torch.utils.dlpack.to_dlpack(producer))
    assert data_ptr(tensor.as_numpy()) == producer.data_ptr()
    del producer
    gc.collect()
    assert watch() is not None  # the Tensor holds the producer
    np.testing.assert_array_equal(tensor.as_numpy(), np.arange(6))
    del tensor
    gc.collect()
    assert watch() is None


def test_from_dlpack_takes_protocol_objects_and_bf16_keeps_its_bits() -> None:
    values = torch.tensor([1.0, -2.5, 3.140625], dtype=torch.bfloat16)
    tensor = pb_utils.Tensor.from_dlpack("b", values)
    assert tensor.triton_dtype() == pb_utils.TYPE_BF16
    assert tensor.storage.dtype == np.uint16
    assert np.array_equal(tensor.storage, values.view(torch.int16).numpy().view(np.uint16))
    again = pb_utils.Tensor.from_dlpack("c", tensor.to_dlpack())
    assert torch.equal(torch.from_dlpack(again), values)


def test_from_dlpack_of_a_tensor_shares_it_and_keeps_what_it_keeps() -> None:
    """A pb_utils.Tensor passed on (a BLS output renamed for the next call): the same
    memory, and whatever held the first one's memory lives until both are gone."""
    owner = Owner()
    watch = weakref.ref(owner)
    first = pb_utils.Tensor.from_dlpack("a", dlpack.capsule_from_array(
        np.arange(4, dtype=np.float32), dtypes.BY_WIRE["FP32"]))  # fmt: skip
    first._keepalive = (first._keepalive, owner)  # stands for a lent output's keepalive
    del owner
    second = pb_utils.Tensor.from_dlpack("b", first)
    assert (second.name(), second.triton_dtype(), second.shape()) == ("b", pb_utils.TYPE_FP32, [4])
    second.as_numpy()[0] = 7
    assert first.as_numpy()[0] == 7
    del first
    gc.collect()
    assert watch() is not None
    del second
    gc.collect()
    assert watch() is None
    bf16 = pb_utils.Tensor.from_dlpack("c", torch.tensor([1.5], dtype=torch.bfloat16))
    assert pb_utils.Tensor.from_dlpack("d", bf16).triton_dtype() == pb_utils.TYPE_BF16
    words = pb_utils.Tensor("s", np.array([b"x"], dtype=np.object_))
    with pytest.raises(pb_utils.TritonModelException, match="string tensors"):
        pb_utils.Tensor.from_dlpack("t", words)


def test_from_dlpack_of_a_gpu_tensor_stays_on_its_device() -> None:
    first = pb_utils.Tensor.from_dlpack("g", cuda_capsule((2, 3)))
    second = pb_utils.Tensor.from_dlpack("h", first)
    assert not second.is_cpu() and second.shape() == [2, 3]
    info, _ = dlpack.import_capsule(second.to_dlpack())
    assert (info.ptr, info.device_type, info.device_id) == (0xDEAD0000, dlpack.CUDA, 1)


def test_from_dlpack_of_non_contiguous_host_tensor_copies_it() -> None:
    producer = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    tensor = pb_utils.Tensor.from_dlpack("t", producer)
    assert tensor.as_numpy().flags.c_contiguous
    np.testing.assert_array_equal(tensor.as_numpy(), producer.numpy())
    assert tensor.shape() == [4, 3]


def test_from_dlpack_refuses_what_is_not_dlpack() -> None:
    with pytest.raises(pb_utils.TritonModelException, match="must be a DLPack capsule"):
        pb_utils.Tensor.from_dlpack("x", [1, 2, 3])
    with pytest.raises(pb_utils.TritonModelException, match="empty string"):
        pb_utils.Tensor.from_dlpack("", torch.zeros(1))


# --- GPU tensors, described by capsules over device pointers (never dereferenced here) ---


class Owner:
    pass


def cuda_capsule(shape: tuple[int, ...], strides: tuple[int, ...] | None = None) -> object:
    fp32 = dtypes.BY_WIRE["FP32"]
    return dlpack.export_capsule(0xDEAD0000, shape, fp32, dlpack.CUDA, 1, Owner(), strides)


def test_gpu_tensor_stays_on_its_device_through_dlpack() -> None:
    tensor = pb_utils.Tensor.from_dlpack("g", cuda_capsule((2, 3)))
    assert not tensor.is_cpu()
    assert tensor.shape() == [2, 3]
    assert tensor.__dlpack_device__() == (dlpack.CUDA, 1)
    info, _ = dlpack.import_capsule(tensor.to_dlpack())
    assert (info.ptr, info.device_type, info.device_id) == (0xDEAD0000, dlpack.CUDA, 1)
    assert info.shape == (2, 3)


def test_non_contiguous_gpu_tensor_is_refused_with_tritons_message() -> None:
    with pytest.raises(pb_utils.TritonModelException, match="not contiguous"):
        pb_utils.Tensor.from_dlpack("g", cuda_capsule((2, 3), strides=(1, 2)))


def test_gpu_tensor_host_copy_without_cuda_python_says_what_is_missing() -> None:
    try:
        import cuda.bindings  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("cuda-python is installed: the copy would touch a fake device pointer")
    tensor = pb_utils.Tensor.from_dlpack("g", cuda_capsule((2,)))
    with pytest.raises(pb_utils.TritonModelException, match="needs cuda-python"):
        tensor.as_numpy()
