"""HTTP/2 (RFC 9113) and HPACK (RFC 7541) conformance of the gRPC port, raw frames against
the real server: one case per check of h2spec's families (generic; 3.5 preface; 4.1-4.3
frame format, size, header compression; 5.1-5.5 stream states, identifiers, concurrency,
priority, error handling, extensions; 6.1-6.10 each frame type; 8.1 the request's fields;
HPACK 2.3, 4.2, 5.2, 6), each asserting what the server answers: a GOAWAY's code (a
connection error), an RST_STREAM's (a stream error), a response, or nothing wrong (the
PING sent after the frames is answered). Stream errors are RST_STREAM and connection
errors GOAWAY exactly where RFC 9113 says which; where it leaves the choice, the case
says ours."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from h2_raw import EMPTY_MESSAGE, LIVE, Outcome, Raw, request

from conftest import EXAMPLES, RunningServer, run_server
from dlserve.server.transport.h2.frames import (
    COMPRESSION_ERROR,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADERS,
    MAX_WINDOW,
    PADDED,
    PING,
    PREFACE,
    PRIORITY,
    PRIORITY_FLAG,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    REFUSED_STREAM,
    RST_STREAM,
    SETTINGS,
    STREAM_CLOSED,
    WINDOW_UPDATE,
    frame,
)
from dlserve.server.transport.h2.hpack_codec import encode

OK: Outcome = ("ok",)
ANSWERED: Outcome = ("response", 0)


def goaway(code: int) -> Outcome:
    return ("goaway", code)


def rst(code: int) -> Outcome:
    return ("rst", code)


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with run_server(EXAMPLES) as running:
        yield running


def _u32(value: int) -> bytes:
    return value.to_bytes(4, "big")


def _setting(key: int, value: int) -> bytes:
    return key.to_bytes(2, "big") + _u32(value)


def _literal(name: bytes, value: bytes) -> bytes:
    """A literal field without indexing, name and value as raw strings."""
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


def _huffman_value(name: bytes, coded: bytes) -> bytes:
    """A literal field whose value is the Huffman-coded bytes given, as they are."""
    return b"\x00" + bytes([len(name)]) + name + bytes([0x80 | len(coded)]) + coded


def _opened(raw: Raw, stream: int = 1) -> None:
    """A call opened on ``stream``, its request not ended."""
    raw.headers(stream, request())


def _half_closed(raw: Raw, then: bytes) -> None:
    """``then`` right behind a request that ends the stream (one write: the server reads
    it before it answers, so the stream is half-closed (remote))."""
    raw.send(frame(HEADERS, END_HEADERS | END_STREAM, 1, request()) + then)


def _closed(raw: Raw, then: bytes) -> None:
    """``then`` after a whole call whose response the client has read."""
    raw.call(1)
    assert raw.outcome() == ANSWERED
    raw.send(then)


def _reset(raw: Raw, then: bytes) -> None:
    """``then`` after the client opened a stream and reset it."""
    _opened(raw)
    raw.send(frame(RST_STREAM, 0, 1, _u32(0x8)) + then)


def _too_many_streams(raw: Raw) -> None:
    limit = raw.settings[0x3]
    raw.send(b"".join(frame(HEADERS, END_HEADERS, 1 + 2 * n, request()) for n in range(limit)))
    raw.headers(1 + 2 * limit, request())


def _past_the_window(raw: Raw) -> None:
    """Requests not ended hold the connection's window (no stream's reaches half, when
    it would be given back): ten of 7 MiB go past 64 MiB."""
    size = 7 * 2**20

    for stream in range(1, 21, 2):
        _opened(raw, stream)
        raw.send(frame(DATA, 0, stream, b"\x00" + _u32(size)))
        piece = frame(DATA, 0, stream, bytes(16384))
        raw.send(piece * (size // 16384))


def _too_many_pings(raw: Raw) -> None:
    raw.send(frame(PING, 0, 0, bytes(8)) * 4)


Case = tuple[str, Callable[[Raw], None], Outcome]
_CASES: list[Case] = [
    # -- generic: requests as they should be ---------------------------------------------
    ("generic/call", lambda r: r.call(1), ANSWERED),
    ("generic/continuations", lambda r: r.send(
        frame(HEADERS, 0, 1, request()[:5]) + frame(CONTINUATION, 0, 1, request()[5:12])
        + frame(CONTINUATION, END_HEADERS, 1, request()[12:])
        + frame(DATA, END_STREAM, 1, EMPTY_MESSAGE)), ANSWERED),
    ("generic/padded-and-priority", lambda r: r.send(
        frame(HEADERS, END_HEADERS | PADDED | PRIORITY_FLAG, 1,
              b"\x03" + _u32(0) + b"\x10" + request() + bytes(3))
        + frame(DATA, END_STREAM | PADDED, 1, b"\x02" + EMPTY_MESSAGE + bytes(2))), ANSWERED),
    ("generic/two-streams", lambda r: (r.call(1), r.call(3)), ANSWERED),
    # -- 3.5 the connection preface ------------------------------------------------------
    # -- 4.1 frame format ----------------------------------------------------------------
    ("4.1/unknown-type", lambda r: r.send(frame(0x20, 0, 0, b"x")), OK),
    ("4.1/undefined-flag", lambda r: r.send(frame(PING, 0x16, 0, bytes(8))), OK),
    ("4.1/reserved-bit", lambda r: r.send(
        (8 << 48 | PING << 40 | 1 << 31).to_bytes(9, "big") + bytes(8)), OK),
    # -- 4.2 frame size ------------------------------------------------------------------
    ("4.2/data-16384", lambda r: (_opened(r), r.send(
        frame(DATA, 0, 1, b"\x00" + _u32(16379) + bytes(16379))),
        r.send(frame(DATA, END_STREAM, 1, b""))), ("response",)),
    ("4.2/data-too-large", lambda r: (_opened(r), r.send(frame(DATA, 0, 1, bytes(16385)))),
     goaway(FRAME_SIZE_ERROR)),
    ("4.2/headers-too-large", lambda r: r.send(
        frame(HEADERS, END_HEADERS, 1, request() + _literal(b"x", b"y") * 4000)),
     goaway(FRAME_SIZE_ERROR)),
    # -- 4.3 header compression ----------------------------------------------------------
    ("4.3/invalid-block", lambda r: r.headers(1, b"\x7f\xff\xff\xff\xff\xff"),
     goaway(COMPRESSION_ERROR)),
    ("4.3/priority-inside-block", lambda r: r.send(
        frame(HEADERS, 0, 1, request()) + frame(PRIORITY, 0, 1, _u32(0) + b"\x10")),
     goaway(PROTOCOL_ERROR)),
    ("4.3/headers-inside-block", lambda r: r.send(
        frame(HEADERS, 0, 1, request()) + frame(HEADERS, END_HEADERS, 3, request())),
     goaway(PROTOCOL_ERROR)),
    # -- 5.1 stream states ---------------------------------------------------------------
    ("5.1/idle-data", lambda r: r.send(frame(DATA, 0, 1, b"x")), goaway(PROTOCOL_ERROR)),
    ("5.1/idle-rst", lambda r: r.send(frame(RST_STREAM, 0, 1, _u32(8))),
     goaway(PROTOCOL_ERROR)),
    ("5.1/idle-window-update", lambda r: r.send(frame(WINDOW_UPDATE, 0, 1, _u32(1))),
     goaway(PROTOCOL_ERROR)),
    ("5.1/idle-continuation", lambda r: r.send(frame(CONTINUATION, END_HEADERS, 1, request())),
     goaway(PROTOCOL_ERROR)),
    ("5.1/half-closed-data", lambda r: _half_closed(r, frame(DATA, 0, 1, b"x")),
     rst(STREAM_CLOSED)),
    ("5.1/half-closed-headers", lambda r: _half_closed(
        r, frame(HEADERS, END_HEADERS | END_STREAM, 1, encode([(b"x", b"y")]))),
     rst(STREAM_CLOSED)),
    ("5.1/half-closed-continuation", lambda r: _half_closed(
        r, frame(CONTINUATION, END_HEADERS, 1, b"")), goaway(PROTOCOL_ERROR)),
    ("5.1/reset-data", lambda r: _reset(r, frame(DATA, 0, 1, b"x")), rst(STREAM_CLOSED)),
    ("5.1/reset-headers", lambda r: _reset(
        r, frame(HEADERS, END_HEADERS | END_STREAM, 1, request())), goaway(STREAM_CLOSED)),
    ("5.1/reset-continuation", lambda r: _reset(r, frame(CONTINUATION, END_HEADERS, 1, b"")),
     goaway(PROTOCOL_ERROR)),
    ("5.1/closed-data", lambda r: _closed(r, frame(DATA, 0, 1, b"x")), rst(STREAM_CLOSED)),
    ("5.1/closed-headers", lambda r: _closed(
        r, frame(HEADERS, END_HEADERS | END_STREAM, 1, request())), goaway(STREAM_CLOSED)),
    ("5.1/closed-window-update", lambda r: _closed(r, frame(WINDOW_UPDATE, 0, 1, _u32(1))),
     OK),
    ("5.1/closed-rst", lambda r: _closed(r, frame(RST_STREAM, 0, 1, _u32(8))), OK),
    ("5.1/closed-priority", lambda r: _closed(r, frame(PRIORITY, 0, 1, _u32(0) + b"\x10")), OK),
    # -- 5.1.1 stream identifiers, 5.1.2 concurrency -------------------------------------
    ("5.1.1/even", lambda r: r.headers(2, request(), True), goaway(PROTOCOL_ERROR)),
    ("5.1.1/decreasing", lambda r: (_opened(r, 5), r.headers(3, request(), True)),
     goaway(PROTOCOL_ERROR)),
    ("5.1.2/past-max-concurrent-streams", _too_many_streams, rst(REFUSED_STREAM)),
    # -- 5.3 priority, 5.4 error handling, 5.5 extensions --------------------------------
    ("5.3/headers-depends-on-itself", lambda r: r.headers(
        1, _u32(1) + b"\x10" + request(), True, PRIORITY_FLAG), rst(PROTOCOL_ERROR)),
    ("5.3/priority-depends-on-itself", lambda r: r.send(
        frame(PRIORITY, 0, 1, _u32(1) + b"\x10")), rst(PROTOCOL_ERROR)),
    ("5.4/invalid-ping", lambda r: r.send(frame(PING, 0, 0, bytes(6))),
     goaway(FRAME_SIZE_ERROR)),
    ("5.5/unknown-extension", lambda r: r.send(frame(0xFF, 0, 1, b"ext")), OK),
    ("5.5/unknown-inside-block", lambda r: r.send(
        frame(HEADERS, 0, 1, request()) + frame(0xFF, 0, 1, b"ext")), goaway(PROTOCOL_ERROR)),
    # -- 6.1 DATA ------------------------------------------------------------------------
    ("6.1/stream-0", lambda r: r.send(frame(DATA, 0, 0, b"x")), goaway(PROTOCOL_ERROR)),
    ("6.1/bad-padding", lambda r: (_opened(r), r.send(frame(DATA, PADDED, 1, b"\x05abc"))),
     goaway(PROTOCOL_ERROR)),
    ("6.1/after-end-stream", lambda r: _half_closed(r, frame(DATA, END_STREAM, 1, b"")),
     rst(STREAM_CLOSED)),
    # -- 6.2 HEADERS ---------------------------------------------------------------------
    ("6.2/then-priority", lambda r: r.send(
        frame(HEADERS, 0, 1, request()) + frame(PRIORITY, 0, 1, _u32(0) + b"\x10")),
     goaway(PROTOCOL_ERROR)),
    ("6.2/stream-0", lambda r: r.headers(0, request(), True), goaway(PROTOCOL_ERROR)),
    ("6.2/bad-padding", lambda r: r.send(frame(HEADERS, END_HEADERS | PADDED, 1, b"\x40")),
     goaway(PROTOCOL_ERROR)),
    # -- 6.3 PRIORITY --------------------------------------------------------------------
    ("6.3/stream-0", lambda r: r.send(frame(PRIORITY, 0, 0, _u32(1) + b"\x10")),
     goaway(PROTOCOL_ERROR)),
    ("6.3/length", lambda r: r.send(frame(PRIORITY, 0, 1, _u32(0))), rst(FRAME_SIZE_ERROR)),
    ("6.3/on-idle", lambda r: r.send(frame(PRIORITY, 0, 9, _u32(0) + b"\x10")), OK),
    # -- 6.4 RST_STREAM ------------------------------------------------------------------
    ("6.4/stream-0", lambda r: r.send(frame(RST_STREAM, 0, 0, _u32(8))),
     goaway(PROTOCOL_ERROR)),
    ("6.4/idle", lambda r: r.send(frame(RST_STREAM, 0, 3, _u32(8))), goaway(PROTOCOL_ERROR)),
    ("6.4/length", lambda r: (_opened(r), r.send(frame(RST_STREAM, 0, 1, _u32(8) + b"x"))),
     goaway(FRAME_SIZE_ERROR)),
    ("6.4/unknown-code", lambda r: (_opened(r), r.send(frame(RST_STREAM, 0, 1, _u32(0xFF)))),
     OK),
    # -- 6.5 SETTINGS --------------------------------------------------------------------
    ("6.5/ack-with-payload", lambda r: r.send(frame(SETTINGS, 1, 0, _setting(4, 1))),
     goaway(FRAME_SIZE_ERROR)),
    ("6.5/on-a-stream", lambda r: r.send(frame(SETTINGS, 0, 1, _setting(4, 1))),
     goaway(PROTOCOL_ERROR)),
    ("6.5/length", lambda r: r.send(frame(SETTINGS, 0, 0, bytes(5))),
     goaway(FRAME_SIZE_ERROR)),
    ("6.5.2/enable-push-2", lambda r: r.send(frame(SETTINGS, 0, 0, _setting(2, 2))),
     goaway(PROTOCOL_ERROR)),
    ("6.5.2/initial-window-too-large", lambda r: r.send(
        frame(SETTINGS, 0, 0, _setting(4, MAX_WINDOW + 1))), goaway(FLOW_CONTROL_ERROR)),
    ("6.5.2/max-frame-below", lambda r: r.send(frame(SETTINGS, 0, 0, _setting(5, 16383))),
     goaway(PROTOCOL_ERROR)),
    ("6.5.2/max-frame-above", lambda r: r.send(frame(SETTINGS, 0, 0, _setting(5, 2**24))),
     goaway(PROTOCOL_ERROR)),
    ("6.5.2/unknown-setting", lambda r: r.send(frame(SETTINGS, 0, 0, _setting(0xFF, 1))), OK),
    ("6.5.3/several-initial-windows", lambda r: (r.send(frame(
        SETTINGS, 0, 0, _setting(4, 1) + _setting(4, 65535))), r.call(1)), ANSWERED),
    # -- 6.7 PING, 6.8 GOAWAY ------------------------------------------------------------
    ("6.7/ping-ack-ignored", lambda r: r.send(frame(PING, 1, 0, bytes(8))), OK),
    ("6.7/on-a-stream", lambda r: r.send(frame(PING, 0, 1, bytes(8))),
     goaway(PROTOCOL_ERROR)),
    ("6.7/length", lambda r: r.send(frame(PING, 0, 0, bytes(9))), goaway(FRAME_SIZE_ERROR)),
    ("6.8/on-a-stream", lambda r: r.send(frame(GOAWAY, 0, 1, bytes(8))),
     goaway(PROTOCOL_ERROR)),
    ("6.8/unknown-code", lambda r: r.send(frame(GOAWAY, 0, 0, _u32(0) + _u32(0xFF))), OK),
    # -- 6.9 WINDOW_UPDATE and flow control ----------------------------------------------
    ("6.9/zero-on-connection", lambda r: r.send(frame(WINDOW_UPDATE, 0, 0, _u32(0))),
     goaway(PROTOCOL_ERROR)),
    ("6.9/zero-on-stream", lambda r: (_opened(r), r.send(frame(WINDOW_UPDATE, 0, 1, _u32(0)))),
     rst(PROTOCOL_ERROR)),
    ("6.9/length", lambda r: r.send(frame(WINDOW_UPDATE, 0, 0, bytes(3))),
     goaway(FRAME_SIZE_ERROR)),
    ("6.9.1/connection-past-2^31-1", lambda r: r.send(
        frame(WINDOW_UPDATE, 0, 0, _u32(MAX_WINDOW)) * 2), goaway(FLOW_CONTROL_ERROR)),
    ("6.9.1/stream-past-2^31-1", lambda r: (_opened(r), r.send(
        frame(WINDOW_UPDATE, 0, 1, _u32(MAX_WINDOW)))), rst(FLOW_CONTROL_ERROR)),
    ("6.9.1/data-past-the-window", _past_the_window, goaway(FLOW_CONTROL_ERROR)),
    ("6.9.2/window-negative-then-back", lambda r: (r.send(frame(
        SETTINGS, 0, 0, _setting(4, 0))), r.call(1), r.send(frame(
        SETTINGS, 0, 0, _setting(4, 65535)))), ANSWERED),
    # -- 6.10 CONTINUATION ---------------------------------------------------------------
    ("6.10/then-other-frame", lambda r: r.send(
        frame(HEADERS, 0, 1, request()[:5]) + frame(CONTINUATION, 0, 1, request()[5:])
        + frame(DATA, 0, 1, b"x")), goaway(PROTOCOL_ERROR)),
    ("6.10/stream-0", lambda r: r.send(
        frame(HEADERS, 0, 1, request()[:5]) + frame(CONTINUATION, END_HEADERS, 0, request()[5:])),
     goaway(PROTOCOL_ERROR)),
    ("6.10/after-end-headers", lambda r: (r.headers(1, request()), r.send(
        frame(CONTINUATION, END_HEADERS, 1, b""))), goaway(PROTOCOL_ERROR)),
    ("6.10/after-data", lambda r: (_opened(r), r.send(
        frame(DATA, 0, 1, b"x") + frame(CONTINUATION, END_HEADERS, 1, b""))),
     goaway(PROTOCOL_ERROR)),
    # -- 8.1 HTTP message exchange: a request's fields -----------------------------------
    ("8.1/unknown-pseudo", lambda r: r.headers(1, request(extra=((b":foo", b"x"),)), True),
     rst(PROTOCOL_ERROR)),
    ("8.1/response-pseudo", lambda r: r.headers(1, encode(
        [(b":status", b"200")]) + request(), True), rst(PROTOCOL_ERROR)),
    ("8.1/pseudo-after-regular", lambda r: r.headers(
        1, request(omit=(b":authority",)) + encode([(b":authority", b"x")]), True),
     rst(PROTOCOL_ERROR)),
    ("8.1/pseudo-in-trailers", lambda r: (_opened(r), r.headers(
        1, encode([(b":path", b"/")]), True)), rst(PROTOCOL_ERROR)),
    ("8.1/trailers-without-end-stream", lambda r: (_opened(r), r.headers(
        1, encode([(b"x-t", b"1")]))), rst(PROTOCOL_ERROR)),
    ("8.1/connection-header", lambda r: r.headers(
        1, request(extra=((b"connection", b"keep-alive"),)), True), rst(PROTOCOL_ERROR)),
    ("8.1/te-not-trailers", lambda r: r.headers(1, request(omit=(b"te",), extra=(
        (b"te", b"gzip"),)), True), rst(PROTOCOL_ERROR)),
    ("8.1/uppercase-name", lambda r: r.headers(
        1, request(extra=((b"X-Upper", b"1"),)), True), rst(PROTOCOL_ERROR)),
    ("8.1/empty-path", lambda r: r.headers(1, request(path=b""), True), rst(PROTOCOL_ERROR)),
    *[(f"8.1/missing-{name.decode()}", (lambda n: lambda r: r.headers(
        1, request(omit=(n,)), True))(name), rst(PROTOCOL_ERROR))
      for name in (b":method", b":scheme", b":path")],
    *[(f"8.1/duplicate-{name.decode()}", (lambda n: lambda r: r.headers(
        1, request(omit=(b"content-type", b"te")) + encode([(n, b"x")]), True))(name),
       rst(PROTOCOL_ERROR)) for name in (b":method", b":scheme", b":path")],
    ("8.1/content-length-mismatch", lambda r: (r.headers(1, request(extra=(
        (b"content-length", b"10"),))), r.send(frame(DATA, END_STREAM, 1, EMPTY_MESSAGE))),
     rst(PROTOCOL_ERROR)),
    ("8.2/push-promise", lambda r: r.send(frame(PUSH_PROMISE, END_HEADERS, 1, _u32(2))),
     goaway(PROTOCOL_ERROR)),
    # -- HPACK (RFC 7541) ----------------------------------------------------------------
    ("hpack-2.3.3/indexed-out-of-range", lambda r: r.headers(1, b"\xff\x7f", True),
     goaway(COMPRESSION_ERROR)),
    ("hpack-2.3.3/literal-name-out-of-range", lambda r: r.headers(1, b"\x0f\x7f\x01x", True),
     goaway(COMPRESSION_ERROR)),
    ("hpack-4.2/size-update-at-the-end", lambda r: r.headers(1, request() + b"\x20", True),
     goaway(COMPRESSION_ERROR)),
    ("hpack-5.2/huffman-padding-past-7-bits", lambda r: r.headers(
        1, request() + _huffman_value(b"x", b"\x1f\xff"), True), goaway(COMPRESSION_ERROR)),
    ("hpack-5.2/huffman-padded-by-zero", lambda r: r.headers(
        1, request() + _huffman_value(b"x", b"\x18"), True), goaway(COMPRESSION_ERROR)),
    ("hpack-5.2/huffman-eos", lambda r: r.headers(
        1, request() + _huffman_value(b"x", b"\xff\xff\xff\xff"), True),
     goaway(COMPRESSION_ERROR)),
    ("hpack-5/integer-overflow", lambda r: r.headers(1, b"\xff" + b"\xff" * 10 + b"\x01", True),
     goaway(COMPRESSION_ERROR)),
    ("hpack-6.1/index-0", lambda r: r.headers(1, b"\x80", True), goaway(COMPRESSION_ERROR)),
    ("hpack-6.3/size-update-above-the-limit", lambda r: r.headers(
        1, b"\x3f\xe2\x1f" + request(), True), goaway(COMPRESSION_ERROR)),
    ("hpack-6.3/size-update-at-the-start", lambda r: (r.send(frame(
        HEADERS, END_HEADERS, 1, b"\x20\x3f\xe1\x0f" + request())), r.send(
        frame(DATA, END_STREAM, 1, EMPTY_MESSAGE))), ANSWERED),
    # -- limits --------------------------------------------------------------------------
    ("limit/header-list-size", lambda r: r.headers(1, request(
        extra=tuple((b"x-big-%03d" % n, b"v" * 100) for n in range(130))), True),
     ("response", 8)),
    ("limit/header-block-past-twice-the-list", lambda r: r.send(
        frame(HEADERS, 0, 1, request()) + frame(CONTINUATION, 0, 1, b"\x82" * 16384) * 3),
     goaway(ENHANCE_YOUR_CALM)),
    ("limit/too-many-pings", _too_many_pings, goaway(ENHANCE_YOUR_CALM)),
]  # fmt: skip


@pytest.mark.parametrize(("case", "expected"), [(c[1], c[2]) for c in _CASES],
                         ids=[c[0] for c in _CASES])  # fmt: skip
def test_h2spec_case(server: RunningServer, case: Callable[[Raw], None], expected: Outcome) -> None:
    with Raw(server.grpc_port) as raw:
        case(raw)
        if expected == OK:
            raw.probe()
        outcome = raw.outcome()
    assert outcome[: len(expected)] == expected, outcome


@pytest.mark.parametrize(
    "opening",
    [b"PRI * HTTP/2.0\r\n\r\nXX\r\n\r\n", PREFACE + frame(DATA, 0, 1, b"x"),
     PREFACE + frame(SETTINGS, 1, 0)],
    ids=["3.5/invalid-preface", "3.5/no-settings-first", "3.5/settings-ack-first"],
)  # fmt: skip
def test_the_preface(server: RunningServer, opening: bytes) -> None:
    """RFC 9113 3.4: the client's preface is the fixed string and then a SETTINGS frame."""
    with Raw(server.grpc_port, handshake=False) as raw:
        raw.frame()  # the server's SETTINGS
        raw.send(opening)
        assert raw.outcome()[:2] == goaway(PROTOCOL_ERROR)


def test_the_settings_advertised(server: RunningServer) -> None:
    """SETTINGS_MAX_CONCURRENT_STREAMS and MAX_HEADER_LIST_SIZE are advertised (their
    defaults), and no MAX_FRAME_SIZE: RFC 9113's 16 KiB."""
    with Raw(server.grpc_port) as raw:
        assert raw.settings[0x3] == 1024 and raw.settings[0x6] == 16384
        assert 0x5 not in raw.settings
        raw.headers(1, request(path=LIVE))


def test_the_options_reach_the_connections() -> None:
    """A server started with other limits advertises them, refuses the stream past its
    concurrency, takes larger frames, and PINGs a connection with a call (keepalive)."""
    options = ("--grpc-http2-max-concurrent-streams", "2", "--grpc-http2-max-frame-size",
               "65536", "--grpc-keepalive-time", "100", "--grpc-http2-max-header-list-size",
               "8192")  # fmt: skip
    with run_server(EXAMPLES, *options) as running, Raw(running.grpc_port) as raw:
        assert (raw.settings[0x3], raw.settings[0x5], raw.settings[0x6]) == (2, 65536, 8192)
        part = b"\x00" + (1 << 20).to_bytes(4, "big") + bytes(19995)  # of a 1 MiB message
        raw.send(frame(HEADERS, END_HEADERS, 1, request()) + frame(DATA, 0, 1, part))
        raw.send(
            frame(HEADERS, END_HEADERS, 3, request()) + frame(HEADERS, END_HEADERS, 5, request())
        )
        assert raw.outcome()[:2] == rst(REFUSED_STREAM)
        while True:  # the keepalive PING, within its 100 ms
            kind, flags, _, _ = raw.frame()
            if kind == PING and not flags & 0x1:
                break
