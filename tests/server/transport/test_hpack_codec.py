"""dlserve's HPACK codec against RFC 7541's examples and the ``hpack`` package."""

from __future__ import annotations

import random

import hpack
import pytest

from dlserve.server.transport.h2.hpack_codec import Decoder, HpackError, encode


def test_rfc_7541_c4_requests_with_huffman_and_the_dynamic_table() -> None:
    decoder = Decoder()
    first = bytes.fromhex("828684418cf1e3c2e5f23a6ba0ab90f4ff")
    second = bytes.fromhex("828684be5886a8eb10649cbf")
    third = bytes.fromhex("828785bf408825a849e95ba97d7f8925a849e95bb8e8b4bf")
    assert decoder.decode(first) == [
        (":method", "GET"), (":scheme", "http"), (":path", "/"),
        (":authority", "www.example.com"),
    ]  # fmt: skip
    decoded = decoder.decode(second)
    assert decoded[3:] == [(":authority", "www.example.com"), ("cache-control", "no-cache")]
    assert decoder.decode(third)[3:] == [
        (":authority", "www.example.com"), ("custom-key", "custom-value")
    ]  # fmt: skip


def test_an_indexed_block_means_what_the_table_says_now() -> None:
    """The same bytes name other entries once the table has changed: no stale cache."""
    decoder = Decoder()
    decoder.decode(bytes.fromhex("400161026231"))  # add ("a", "b1"): index 62
    assert decoder.decode(b"\xbe") == [("a", "b1")]
    decoder.decode(bytes.fromhex("400161026232"))  # add ("a", "b2"): now index 62
    assert decoder.decode(b"\xbe") == [("a", "b2")]


def test_against_the_hpack_package() -> None:
    rng = random.Random(7)
    encoder, decoder = hpack.Encoder(), Decoder()
    encoder.header_table_size = 256  # small: entries get evicted
    names = [":path", "content-type", "grpc-timeout", "x-a", "x-b-bin", "user-agent"]
    for _ in range(300):
        headers = [
            (rng.choice(names), "".join(rng.choices("abcxyz0123/=-", k=rng.randint(0, 40))))
            for _ in range(rng.randint(1, 8))
        ]
        block = encoder.encode(headers, huffman=rng.random() < 0.5)
        assert decoder.decode(block) == headers


@pytest.mark.parametrize(
    "block", [b"\xff\xff\xff\xff\xff\xff", b"\x80", b"\xc0", b"\x00\x05ab", b"\x3f\xff\x7f"]
)
def test_bad_blocks_are_errors(block: bytes) -> None:
    with pytest.raises(HpackError):
        Decoder().decode(block)


def test_the_encoder_needs_no_table() -> None:
    fields = [(b":status", b"200"), (b"grpc-status", b"0"), (b"grpc-message", b"x" * 300)]
    block = encode(fields)
    assert hpack.Decoder().decode(block) == [(k.decode(), v.decode()) for k, v in fields]
    assert encode(fields) == block
