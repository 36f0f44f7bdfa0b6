"""pb_utils.Tensor over real CUDA memory (torch as the producer and consumer)."""

from __future__ import annotations

import numpy as np
import pytest

from dlserve import pb_utils as pb_utils
from dlserve.tensors import dlpack

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]


def test_a_cuda_tensor_stays_on_the_gpu_and_shares_memory() -> None:
    producer = torch.arange(12, dtype=torch.float32, device="cuda").reshape(3, 4) * 2
    tensor = pb_utils.Tensor.from_dlpack("g", producer)
    assert not tensor.is_cpu()
    assert tensor.shape() == [3, 4]
    assert tensor.__dlpack_device__() == (dlpack.CUDA, producer.device.index)
    consumer = torch.from_dlpack(tensor)
    assert consumer.is_cuda and consumer.data_ptr() == producer.data_ptr()
    back = torch.utils.dlpack.from_dlpack(tensor.to_dlpack())
    assert back.data_ptr() == producer.data_ptr()


def test_the_host_copy_of_a_cuda_tensor(capsys: pytest.CaptureFixture[str]) -> None:
    producer = torch.linspace(-1, 1, 1000, device="cuda")
    tensor = pb_utils.Tensor.from_dlpack("g", torch.utils.dlpack.to_dlpack(producer))
    host = tensor.as_numpy()
    np.testing.assert_array_equal(host, producer.cpu().numpy())
    assert host is tensor.as_numpy()  # copied once
    assert "copies it to host memory" in capsys.readouterr().err


def test_bf16_on_the_gpu_keeps_its_bits() -> None:
    values = torch.randn(64, device="cuda").to(torch.bfloat16)
    tensor = pb_utils.Tensor.from_dlpack("b", values)
    assert tensor.triton_dtype() == pb_utils.TYPE_BF16
    expected = values.cpu().view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(tensor.storage, expected)


def test_a_strided_cuda_tensor_is_refused() -> None:
    producer = torch.zeros(4, 6, device="cuda").t()
    with pytest.raises(pb_utils.TritonModelException, match="not contiguous"):
        pb_utils.Tensor.from_dlpack("t", producer)


def test_dlpack_honours_the_consumers_stream() -> None:
    """A tensor imported from a producer is ready on the legacy stream; a consumer that
    names its own stream gets that stream made to wait, and reads the finished bytes."""
    n = 1 << 22
    produced = torch.ones(n, device="cuda")
    for _ in range(20):  # queue enough work that a consumer that did not wait would see it
        produced.mul_(1.0001)
    expected = produced.clone().cpu()
    tensor = pb_utils.Tensor.from_dlpack("t", produced)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        consumed = torch.from_dlpack(tensor) * 1  # torch passes side's handle to __dlpack__
    side.synchronize()
    assert torch.equal(consumed.cpu(), expected)
    waits: list[int] = []
    real = pb_utils.gpu.make_stream_wait
    pb_utils.gpu.make_stream_wait = waits.append  # type: ignore[assignment]
    try:
        tensor.__dlpack__(stream=side.cuda_stream)
        tensor.__dlpack__(stream=1)  # the legacy stream itself: nothing to wait for
        tensor.__dlpack__(stream=-1)  # the consumer asks for no synchronization
    finally:
        pb_utils.gpu.make_stream_wait = real
    assert waits == [side.cuda_stream]
