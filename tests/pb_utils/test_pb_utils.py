"""pb_utils' module functions and constants, against Triton's definitions."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from tritonclient.grpc import model_config_pb2 as mc

from dlserve import pb_utils as pb_utils


def test_type_constants_are_model_config_values() -> None:
    for name, value in mc.DataType.items():
        assert getattr(pb_utils, name) == value


@pytest.mark.parametrize(
    ("code", "numpy_type"),
    [
        (1, np.bool_),
        (2, np.uint8),
        (3, np.uint16),
        (4, np.uint32),
        (5, np.uint64),
        (6, np.int8),
        (7, np.int16),
        (8, np.int32),
        (9, np.int64),
        (10, np.float16),
        (11, np.float32),
        (12, np.float64),
        (13, np.object_),
    ],
)
def test_type_conversions_both_ways(code: int, numpy_type: type) -> None:
    assert pb_utils.triton_to_numpy_type(code) is numpy_type
    assert pb_utils.numpy_to_triton_type(numpy_type) == code
    assert pb_utils.numpy_to_triton_type(np.dtype(numpy_type)) == code


def test_type_conversion_edges() -> None:
    assert pb_utils.triton_to_numpy_type(pb_utils.TYPE_BF16) is None  # numpy has no bfloat16
    assert pb_utils.numpy_to_triton_type(np.bytes_) == pb_utils.TYPE_STRING
    assert pb_utils.numpy_to_triton_type(np.complex64) is None
    assert pb_utils.triton_string_to_numpy("TYPE_FP32") is np.float32
    assert pb_utils.triton_string_to_numpy("TYPE_BOOL") is bool
    assert pb_utils.triton_string_to_numpy("TYPE_STRING") is np.object_
    with pytest.raises(KeyError):
        pb_utils.triton_string_to_numpy("TYPE_BF16")


def test_serialize_and_deserialize_bytes() -> None:
    array = np.array([[b"ab", "c\u00e9"], [b"", b"\x00\x01"]], dtype=np.object_)
    raw = pb_utils.serialize_byte_tensor(array)
    expected = b"".join(
        struct.pack("<I", len(s)) + s for s in [b"ab", "c\u00e9".encode(), b"", b"\x00\x01"]
    )
    assert raw == expected
    assert isinstance(raw, bytes)
    back = pb_utils.deserialize_bytes_tensor(raw)
    assert back.dtype == np.object_
    assert list(back) == [b"ab", "c\u00e9".encode(), b"", b"\x00\x01"]
    assert list(pb_utils.deserialize_bytes_tensor(np.frombuffer(raw, np.uint8))) == list(back)


def test_serialize_edges_as_in_triton() -> None:
    assert pb_utils.serialize_byte_tensor(np.array([], dtype=np.object_)) == ()
    assert pb_utils.serialize_byte_tensor(np.zeros(2, np.float32)) is None
    with pytest.raises(pb_utils.TritonModelException, match="truncated"):
        pb_utils.deserialize_bytes_tensor(struct.pack("<I", 9) + b"abc")


def test_config_lookups_take_dicts_and_json() -> None:
    config = {
        "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [4]}],
        "output": [{"name": "OUTPUT0", "data_type": "TYPE_INT32", "dims": [-1]}],
    }
    assert pb_utils.get_input_config_by_name(config, "INPUT0")["dims"] == [4]
    assert pb_utils.get_input_config_by_name(config, "OUTPUT0") is None
    assert (
        pb_utils.get_output_config_by_name(json.dumps(config), "OUTPUT0")["data_type"]
        == "TYPE_INT32"
    )
    assert not pb_utils.using_decoupled_model_transaction_policy(config)
    assert pb_utils.using_decoupled_model_transaction_policy(
        {"model_transaction_policy": {"decoupled": True}}
    )
