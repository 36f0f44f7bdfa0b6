"""The SDK's pure parts: URLs, devices, region sizes, fixed-size outputs, input forms."""

from __future__ import annotations

import numpy as np
import pytest

from dlserve.client._outputs import fixed_outputs
from dlserve.client._pool import MIN_REGION, aligned, region_size
from dlserve.client._request import Target, device_of, parse_url
from dlserve.client._tensors import HostInput, describe


@pytest.mark.parametrize(
    ("url", "target"),
    [("localhost:8001", Target("grpc", "localhost:8001", True)),
     ("127.0.0.1:9", Target("grpc", "127.0.0.1:9", True)),
     ("grpc://10.0.0.2:9", Target("grpc", "10.0.0.2:9", False)),
     ("http://localhost", Target("http", "localhost:8000", True)),
     ("https://example.com:443", Target("http", "example.com:443", False, ssl=True)),
     ("http://[::1]:8000", Target("http", "[::1]:8000", True)),
     ("unix:///tmp/d.sock", Target("grpc", "unix:/tmp/d.sock", True)),
     ("unix:/tmp/d.sock", Target("grpc", "unix:/tmp/d.sock", True))],
)  # fmt: skip
def test_urls(url: str, target: Target) -> None:
    assert parse_url(url) == target


def test_a_bad_scheme() -> None:
    with pytest.raises(ValueError, match="unsupported URL scheme"):
        parse_url("ftp://host:1")


@pytest.mark.parametrize(
    ("spec", "device"),
    [(None, None), ("cpu", None), ("cuda", 0), ("cuda:3", 3), (2, 2)],
)
def test_devices(spec: object, device: int | None) -> None:
    assert device_of(spec) == device


def test_a_bad_device() -> None:
    with pytest.raises(ValueError, match="unknown output device"):
        device_of("tpu:0")


def test_region_sizes() -> None:
    assert region_size(1) == MIN_REGION
    assert region_size(MIN_REGION + 1) == 2 * MIN_REGION
    assert region_size(65 << 20) == 66 << 20  # past 64 MiB: 2 MiB steps, not doubling
    assert [aligned(n) for n in (0, 1, 256, 257)] == [0, 256, 256, 512]


def test_fixed_outputs() -> None:
    config = {
        "output": [
            {"name": "fixed", "data_type": "TYPE_FP32", "dims": ["1", "3"]},
            {"name": "variable", "data_type": "TYPE_FP32", "dims": ["-1"]},
            {"name": "strings", "data_type": "TYPE_STRING", "dims": ["2"]},
            {"name": "reshaped", "data_type": "TYPE_FP32", "dims": ["2"], "reshape": {}},
        ]
    }
    layouts = fixed_outputs(config)
    assert list(layouts) == ["fixed"]
    assert layouts["fixed"].nbytes == 12 and layouts["fixed"].shape == (1, 3)
    assert fixed_outputs({**config, "max_batch_size": 8}) == {}  # the batch is unknown


def test_inputs_of_every_form() -> None:
    torch = pytest.importorskip("torch")
    for value in ([1.5, 2.5], np.array([1.5, 2.5], np.float32)[::1], torch.tensor([1.5, 2.5])):
        described = describe("x", value)
        assert isinstance(described, HostInput)
        assert described.shape == [2] and bytes(described.data)[:4] != b""
    strided = describe("s", np.arange(8, dtype=np.int32)[::2])
    assert isinstance(strided, HostInput) and strided.dtype.wire == "INT32"
    assert bytes(strided.data) == np.array([0, 2, 4, 6], np.int32).tobytes()
    strings = describe("b", np.array(["a", "bc"]))
    assert isinstance(strings, HostInput) and strings.dtype.wire == "BYTES"
    assert bytes(strings.data) == b"\x01\x00\x00\x00a\x02\x00\x00\x00bc"
    transposed = torch.arange(6, dtype=torch.float32).reshape(2, 3).t()  # strided, on the host
    described = describe("t", transposed)
    assert isinstance(described, HostInput) and described.shape == [3, 2]
    assert bytes(described.data) == transposed.contiguous().numpy().tobytes()
