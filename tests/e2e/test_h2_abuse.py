"""HTTP/2 abuse against the real server, while a bystander (``bystander.py``) measures
what another client sees: a rapid-reset flood (CVE-2023-44487), a 16 MiB header block
of HPACK references, a stream of empty CONTINUATION frames, SETTINGS and PING floods,
DATA past the windows. Each attack ends, on every connection it opens, in GOAWAY with
the code the limits name, and the bystander's health checks and inferences stay within
the liveness bound meanwhile. Attacks run in a child process at the lowest priority (the
attacker's CPU is not the server's), each for ``FLOOD_S``: a flood on a connection until
its GOAWAY, then another; an attack that writes once, on a connection after another. The
memory the same attacks cost: test_h2_memory.py."""

from __future__ import annotations

import multiprocessing
import os
import select
import time
from collections.abc import Callable, Iterator

import pytest
from bystander import Bystander, p99
from h2_raw import Raw, request

from conftest import EXAMPLES, RunningServer, run_server
from dlserve.server.transport.h2.frames import (
    CONTINUATION,
    DATA,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    GOAWAY,
    HEADERS,
    PING,
    RST_STREAM,
    SETTINGS,
    frame,
)

FLOOD_S = 3.0
MIB = 2**20


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with run_server(EXAMPLES) as running:
        yield running


@pytest.fixture(scope="module")
def elsewhere() -> Iterator[RunningServer]:
    """Another server on the machine: the same flood there shows what the machine's two
    cores cost the bystander, without this server's share."""
    with run_server(EXAMPLES) as running:
        yield running


@pytest.fixture(scope="module")
def bystander(server: RunningServer) -> Iterator[Bystander]:
    with Bystander(server.http_url, server.grpc_url) as watching:
        yield watching


def goaway_if_any(raw: Raw) -> int | None:
    """The code of a GOAWAY the server has sent, reading what has come without waiting;
    -1: closed without one; None: neither yet."""
    while select.select([raw.sock], [], [], 0)[0]:
        try:
            kind, _, _, payload = raw.frame()
        except (EOFError, ConnectionResetError):
            return -1
        if kind == GOAWAY:
            return int.from_bytes(payload[4:8], "big")
    return None


# -- the floods: what each connection sends, a batch at a time ------------------------------
def _rapid_reset(batch: int) -> bytes:
    first = 1 + 200 * batch
    return b"".join(
        frame(HEADERS, 0x4, s, request()) + frame(RST_STREAM, 0, s, (8).to_bytes(4, "big"))
        for s in range(first, first + 200, 2)
    )


def _settings(batch: int) -> bytes:
    return frame(SETTINGS, 0, 0, b"\x00\x04\x00\x01\x00\x00") * 100


def _pings(batch: int) -> bytes:
    return frame(PING, 0, 0, bytes(8)) * 100


def _continuations(batch: int) -> bytes:
    head = frame(HEADERS, 0, 1, request()) if batch == 0 else b""
    return head + frame(CONTINUATION, 0, 1, b"") * 100


FLOODS: dict[str, Callable[[int], bytes]] = {
    "rapid-reset": _rapid_reset, "settings": _settings, "pings": _pings,
    "empty-continuations": _continuations,
}  # fmt: skip


def _flood_child(port: int, name: str, seconds: float, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    os.nice(19)
    unit = FLOODS[name]
    codes: list[int] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:  # a connection after another, each to its end
        with Raw(port) as raw:
            code = None
            batch = 0
            while code is None and time.monotonic() < deadline + 5:
                raw.send(unit(batch))
                batch += 1
                code = goaway_if_any(raw)
            codes.append(-2 if code is None else code)
    out.put(codes)


# Measured on a 2-core machine: the same flood aimed at another server on the machine
# costs the bystander as much or more (p99 3.2-4.2 ms against 1.4-2.4 ms when it is aimed
# at this one; 0.6 ms alone): what misses the bound is the cores' share. On a 16-core host
# every flood meets it: the server handles a connection's frames about 100 us a turn of
# its loop, and a connection spending its flood budget waits 1 ms between turns
# (docs/network-edge.md).
FLOOD_GAP = (
    "the flooding process takes cores the bystander needs (on a small machine; on 16 cores"
    " the floods meet the bound): the same flood at another server costs it"
)
WRITE_GAPS = {
    "16MiB-of-references": (
        "the server takes 32 KiB of the block before its GOAWAY; the writing process's 16 MiB"
        " (a connection after another) is most of what the bystander waits for, and on a"
        " small machine it takes cores the bystander needs: the same writes to another"
        " server cost it"
    ),
    "data-past-the-window": (
        "the server reads and gathers the 70 MiB of each connection 256 KiB a turn of its loop,"
        " one turn of the connection per turn of the loop, behind what each poll woke;"
        " on a small machine the writing process also takes cores the bystander needs, and"
        " on a VM whose host takes back the guest's free memory each fresh page's first"
        " write waits for the host (docs/network-edge.md, The server's pages): the same"
        " writes to another server cost it"
    ),
}


def _flood(port: int, name: str) -> list[int]:
    context = multiprocessing.get_context("fork")
    out = context.Queue()
    child = context.Process(target=_flood_child, args=(port, name, FLOOD_S, out))
    child.start()
    codes: list[int] = out.get(timeout=60)
    child.join(10)
    return codes


@pytest.mark.parametrize("name", sorted(FLOODS))
def test_a_flood_gets_enhance_your_calm_and_others_are_served(
    server: RunningServer, elsewhere: RunningServer, bystander: Bystander, name: str
) -> None:
    """The flood's connections end in ENHANCE_YOUR_CALM and the bystander's health checks
    stay within the bound. Its p99 against its p99 alone is reported as a known gap where
    the machine's cores miss it, with what the same flood at another server of the machine
    costs it (the machine's share, without this server's)."""
    alone = bystander.alone()
    with bystander.watching() as control:
        _flood(elsewhere.grpc_port, name)
    with bystander.watching() as seen:
        codes = _flood(server.grpc_port, name)
    seen.check_health()
    goaways = [code for code in codes if code >= 0]
    assert goaways and set(goaways) == {ENHANCE_YOUR_CALM}, codes
    assert -2 not in codes  # no connection went on without an answer
    seen.p99_or_known_gap(alone, f"{FLOOD_GAP} (p99 {p99(control.infer) * 1e3:.2f} ms)")


# -- write once: a header block of references, DATA past the window -------------------------
def _reference_bomb(raw: Raw) -> None:
    """16 MiB of one-byte HPACK references in one header block."""
    piece = b"\x82" * 16384
    raw.send(frame(HEADERS, 0, 1, piece) + frame(CONTINUATION, 0, 1, piece) * 1023)


def past_the_window(raw: Raw, streams: int = 10) -> None:
    """Requests not ended, 7 MiB each: ten go past the connection's 64 MiB."""
    size = 7 * MIB
    piece = bytes(16384)
    for n in range(streams):
        stream = 1 + 2 * n
        raw.headers(stream, request())
        raw.send(frame(DATA, 0, stream, b"\x00" + size.to_bytes(4, "big")))
        raw.send(frame(DATA, 0, stream, piece) * (size // 16384))


WRITES: dict[str, tuple[Callable[[Raw], None], int]] = {
    "16MiB-of-references": (_reference_bomb, ENHANCE_YOUR_CALM),
    "data-past-the-window": (past_the_window, FLOW_CONTROL_ERROR),
}


def _writes_child(port: int, name: str, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    """The write on a connection after another for ``FLOOD_S`` (three at least): the
    bystander's p99 is then of a thousand calls or more, not its slowest of a few dozen."""
    os.nice(19)  # 70 MiB written is the attacker's CPU too
    attack, _ = WRITES[name]
    codes = []
    deadline = time.monotonic() + FLOOD_S
    while time.monotonic() < deadline or len(codes) < 3:
        with Raw(port) as raw:
            attack(raw)
            codes.append(raw.goaway())
    out.put(codes)


def _writes(port: int, name: str) -> list[int]:
    context = multiprocessing.get_context("fork")
    out = context.Queue()
    child = context.Process(target=_writes_child, args=(port, name, out))
    child.start()
    codes = out.get(timeout=120)
    child.join(10)
    return codes


@pytest.mark.parametrize("name", sorted(WRITES))
def test_a_single_write_attack_gets_its_goaway_and_others_are_served(
    server: RunningServer, elsewhere: RunningServer, bystander: Bystander, name: str
) -> None:
    """Each write ends in its GOAWAY; the bystander's bounds, where the machine's cores
    miss them, are a known gap reported with what the same writes to another server of
    the machine cost it."""
    alone = bystander.alone()
    with bystander.watching() as control:
        _writes(elsewhere.grpc_port, name)
    with bystander.watching() as seen:
        codes = _writes(server.grpc_port, name)
    assert len(codes) >= 3 and set(codes) == {WRITES[name][1]}
    gap = WRITE_GAPS[name]
    seen.bounds_or_known_gap(alone, f"{gap} (p99 {p99(control.infer) * 1e3:.2f} ms)")
