"""Fuzzing the HTTP frontend's request decoding: the KServe JSON request header and
Triton's binary tensor data extension (``convert.parse_infer_request`` with the header's
length from ``bodies.header_length``), and Content-Encoding (``bodies.decompress``).
Arbitrary JSON, well-formed requests with their fields mutated (shapes, data nested or
ragged, datatypes, binary_data_size, Inference-Header-Content-Length) and arbitrary bytes:
each is decoded, or refused with a 4xx and a message (501 for what is not implemented); no
other exception, never a 500.

The suite runs a fixed, derandomized few; ``tools/fuzz.py http`` runs them longer, with
random seeds (``fuzzing.py``)."""

from __future__ import annotations

import asyncio
import json
import zlib
from typing import Any

from hypothesis import HealthCheck, given
from hypothesis import strategies as st

from dlserve import errors
from dlserve.server.frontends.http import bodies, convert
from dlserve.server.frontends.http.status_codes import error_reply
from fuzzing import fuzz_settings

FUZZ = fuzz_settings(600, suppress=HealthCheck)
DATATYPES = ["BOOL", "UINT8", "INT8", "INT16", "INT32", "INT64", "UINT64", "FP16", "BF16",
             "FP32", "FP64", "BYTES", "FP8", ""]  # fmt: skip

_SCALAR = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=8)
)
_JSON = st.recursive(
    _SCALAR,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=20,
)
_SHAPE = st.lists(st.integers(-2, 4), max_size=4)
_DATA = st.one_of(
    st.recursive(
        st.one_of(st.integers(-300, 300), st.floats(), st.booleans(), st.text(max_size=4)),
        lambda inner: st.lists(inner, max_size=4),
        max_leaves=24,
    ),
    _JSON,
)
_PARAMS = st.dictionaries(
    st.sampled_from(
        [
            "binary_data_size",
            "binary_data",
            "shared_memory_region",
            "shared_memory_byte_size",
            "shared_memory_offset",
            "classification",
            "binary_data_output",
            "x",
        ]
    ),
    st.one_of(st.integers(-5, 64), st.booleans(), st.text(max_size=4), st.floats()),
    max_size=3,
)


@st.composite
def _input(draw: st.DrawFn) -> dict[str, Any]:
    item: dict[str, Any] = {
        "name": draw(st.sampled_from(["A", "B", ""])),
        "datatype": draw(st.sampled_from(DATATYPES)),
        "shape": draw(_SHAPE),
    }
    if draw(st.booleans()):
        item["data"] = draw(_DATA)
    if draw(st.booleans()):
        item["parameters"] = draw(_PARAMS)
    for key in draw(st.lists(st.sampled_from(["name", "datatype", "shape"]), max_size=1)):
        item[key] = draw(_JSON)  # a field of the wrong type
    return item


@st.composite
def _body(draw: st.DrawFn) -> tuple[bytes, bytes | None]:
    """A request body and its Inference-Header-Content-Length (None: absent)."""
    header: Any = {
        "inputs": draw(st.lists(_input(), max_size=3)),
        "outputs": draw(st.lists(st.fixed_dictionaries(
            {"name": st.sampled_from(["A", "B"])}, optional={"parameters": _PARAMS}), max_size=2)),
        "parameters": draw(_PARAMS),
    }  # fmt: skip
    if draw(st.integers(0, 9)) == 0:
        header = draw(_JSON)
    encoded = json.dumps(header).encode()
    blobs = draw(st.binary(max_size=64))
    length = draw(st.one_of(st.none(), st.integers(-3, len(encoded) + 8).map(str),
                            st.text(max_size=3)))  # fmt: skip
    if length is None and blobs:
        length = str(len(encoded))
    raw_length = None if length is None else length.encode("utf-8", "replace")
    body = encoded + blobs
    if draw(st.integers(0, 5)) == 0:  # arbitrary bytes
        body = draw(st.binary(max_size=128))
    return body, raw_length


def _refused(exc: errors.DlserveError) -> None:
    """A 4xx with a message (or 501 for what is not implemented, as Triton answers)."""
    status, message = error_reply(exc)
    assert 400 <= status < 500 or (status == 501 and isinstance(exc, errors.UnsupportedError))
    assert json.loads(message)["error"], message


def _decode(body: bytes, raw_length: bytes | None) -> None:
    """Decoded, or refused with a 4xx and a message; anything else fails the test."""
    try:
        length = bodies.header_length(raw_length, len(body))
        if length:
            request, _ = convert.parse_infer_request(body, length, "m", "")
            assert isinstance(request.inputs, list)
    except errors.DlserveError as exc:
        _refused(exc)


@FUZZ
@given(_body())
def test_infer_bodies_decode_or_get_a_4xx(case: tuple[bytes, bytes | None]) -> None:
    _decode(*case)


@FUZZ
@given(_input())
def test_json_tensors_decode_or_get_a_4xx(item: dict[str, Any]) -> None:
    _decode(json.dumps({"inputs": [item]}).encode(), None)


@FUZZ
@given(st.binary(max_size=256), st.sampled_from([b"gzip", b"deflate", b"br"]), st.booleans())
def test_compressed_bodies_inflate_or_get_a_4xx(data: bytes, encoding: bytes, valid: bool) -> None:
    if valid:  # a real stream, cut or not
        data = zlib.compress(data)[: len(data) // 2 or None]
    try:
        out = asyncio.run(bodies.decompress(data, encoding, 128))
        assert len(out) <= 128
    except errors.DlserveError as exc:
        _refused(exc)


def test_regressions() -> None:
    """Bodies found by the fuzzer, or written by hand, kept."""
    for body, length in (
        (b'{"inputs":[{"name":"A","datatype":"BYTES","shape":[1],"data":[[[["a"]]]]}]}', None),
        (b'{"inputs":[{"name":"A","datatype":"INT8","shape":[1],"data":[1e400]}]}', None),
        (b'{"inputs":[{"name":"A","datatype":"FP32","shape":[-1],"data":[]}]}', None),
        (b'{"inputs":[{"name":"A","datatype":"FP16","shape":[1],"data":[1e300]}]}', None),
    ):
        _decode(body, length)
