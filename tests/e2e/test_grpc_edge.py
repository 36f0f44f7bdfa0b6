"""The gRPC edge against a client that breaks the rules (docs/network-edge.md, gRPC):
framing, decompression bombs, messages that are no ModelInferRequest, slow readers.

A real server with real workers; the attacks speak HTTP/2 by hand (``grpc_raw.py``) or
through grpc's own channel; a bystander (``bystander.py``) checks that other clients are
served meanwhile; memory is the server's and its workers' RSS (psutil). The servers run
with small limits so that the bounds are quick to show; the slow readers' one with
glibc's mmap threshold fixed (``MALLOC_MMAP_THRESHOLD_``): otherwise glibc raises it
after a large free and keeps what later large buffers used in its heap, and RSS would
show what the allocator keeps, not what the server holds (that it holds nothing more is
shown without it too: RSS flat over repetitions).
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient
from bystander import Bystander, Seen, p99
from grpc_raw import INFER, STREAM_INFER, RawGrpc, message
from tritonclient.grpc import service_pb2 as pb

from conftest import EXAMPLES, RunningServer, repository_of, run_server
from dlserve.server.transport.grpc.budget import FIRST_CALLS

TEST_MODELS = Path(__file__).parents[1] / "models"
MAX_INFLATED = 16 << 20
SEND_BUDGET = 16 << 20
SEND_TIMEOUT_S = 2.0
OPTIONS = (
    "--grpc-max-decompressed-size", str(MAX_INFLATED),
    "--grpc-connection-send-budget", str(SEND_BUDGET),
    "--grpc-send-timeout", str(SEND_TIMEOUT_S),
)  # fmt: skip
OUTPUT = 4 << 20  # what one request to ``sized_output`` makes the server produce
SLACK = 16 << 20  # what else moves while a test measures (allocator, buffers in flight)

INTERNAL, UNIMPLEMENTED = grpc.StatusCode.INTERNAL.value[0], grpc.StatusCode.UNIMPLEMENTED.value[0]
RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]
RUNS_PAST = "malformed ModelInferRequest: field runs past the end of the message"
CUT_SHORT = "the call ended inside a message: its length prefix says more than was sent"
ONE_MESSAGE = "a unary call needs exactly one request message"
NO_ENCODING = "a compressed message on a call without grpc-encoding"


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repository")
    return repository_of(root, EXAMPLES / "identity_fp32", TEST_MODELS / "sized_output")


@pytest.fixture(scope="module")
def server(repository: Path) -> Iterator[RunningServer]:
    with run_server(repository, *OPTIONS) as running:
        yield running


@pytest.fixture(scope="module")
def slow_server(repository: Path) -> Iterator[RunningServer]:
    """With glibc's mmap threshold fixed: RSS shows what the server holds."""
    with run_server(
        repository, *OPTIONS, env={"MALLOC_MMAP_THRESHOLD_": str(128 << 10)}
    ) as running:
        yield running


def processes(server: RunningServer) -> list[psutil.Process]:
    """The server and its workers."""
    process = psutil.Process(server.process.pid)
    return [process, *process.children(recursive=True)]


def memory(server: RunningServer, among: list[psutil.Process] | None = None) -> int:
    """The server's RSS and its workers'."""
    return sum(process.memory_info().rss for process in among or processes(server))


class Peak:
    """The largest ``memory`` seen while the ``with`` block runs (sampled every 10 ms)."""

    def __init__(self, server: RunningServer) -> None:
        self.server = server
        self.among = processes(server)  # found once: a scan of /proc costs
        self.peak = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> Peak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()

    def _sample(self) -> None:
        while not self._done.wait(0.01):
            self.peak = max(self.peak, memory(self.server, self.among))


def identity_request(model: str = "identity_fp32") -> bytes:
    tensor = pb.ModelInferRequest.InferInputTensor(name="INPUT0", datatype="FP32", shape=[1, 4])
    data = np.arange(4, dtype=np.float32).tobytes()
    return pb.ModelInferRequest(
        model_name=model, inputs=[tensor], raw_input_contents=[data]
    ).SerializeToString()


def sized_request(size: int = OUTPUT) -> bytes:
    tensor = pb.ModelInferRequest.InferInputTensor(name="SIZE", datatype="INT64", shape=[1])
    data = np.array([size], np.int64).tobytes()
    return pb.ModelInferRequest(
        model_name="sized_output", inputs=[tensor], raw_input_contents=[data]
    ).SerializeToString()


# -- framing: what grpc says a client gets ------------------------------------------------------
VALID = identity_request()


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b"", (UNIMPLEMENTED, ONE_MESSAGE)),
        (message(VALID) * 2, (UNIMPLEMENTED, ONE_MESSAGE)),
        (message(VALID) + b"\x00\x01", (INTERNAL, CUT_SHORT)),  # stray bytes after it
        (message(VALID)[:-1], (INTERNAL, CUT_SHORT)),  # the prefix says more than was sent
        # the prefix says less: the message it frames is refused, its last field cut short,
        # as soon as that is known (before the stray byte after it)
        (b"\x00" + (len(VALID) - 1).to_bytes(4, "big") + VALID, (INVALID_ARGUMENT, RUNS_PAST)),
        (message(VALID, flag=1), (INTERNAL, NO_ENCODING)),
        (message(VALID, flag=7), (INTERNAL, "a message's Compressed-Flag must be 0 or 1, not 7")),
    ],
    ids=["none", "two", "stray-bytes", "prefix-longer", "prefix-shorter", "flag-no-encoding",
         "bad-flag"],
)  # fmt: skip
def test_a_unary_call_that_breaks_the_framing_gets_grpcs_status(
    server: RunningServer, body: bytes, expected: tuple[int, str]
) -> None:
    raw = RawGrpc(server.grpc_url)
    try:
        assert raw.status(raw.call(INFER, body)) == expected
        assert raw.status(raw.call(INFER, message(VALID))) == (0, "")  # the connection goes on
    finally:
        raw.close()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    assert client.is_server_ready()


# -- decompression bombs ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bombs() -> dict[str, bytes]:
    """1 GiB of zeros as one gzip and one deflate stream (about 1 MiB each)."""
    out = {}
    zeros = bytes(1 << 20)
    for encoding, wbits in (("gzip", 16 + zlib.MAX_WBITS), ("deflate", zlib.MAX_WBITS)):
        squeeze = zlib.compressobj(9, zlib.DEFLATED, wbits)
        out[encoding] = b"".join([squeeze.compress(zeros) for _ in range(1024)] + [squeeze.flush()])
    return out


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
@pytest.mark.parametrize("path", [INFER, STREAM_INFER], ids=["unary", "streaming"])
def test_a_bomb_is_refused_with_tritons_size_message_within_the_bound(
    server: RunningServer, bombs: dict[str, bytes], encoding: str, path: bytes
) -> None:
    """A bomb of 1 GiB (1 MiB sent) is refused RESOURCE_EXHAUSTED once it inflates past
    --grpc-max-decompressed-size, in slices; the server grows by no more than that (plus
    slack), and another client is served meanwhile (over two seconds, as it is alone)."""
    raw = RawGrpc(server.grpc_url)
    header = (b"grpc-encoding", encoding.encode())
    with Bystander(server.http_url, server.grpc_url) as bystander:
        alone = bystander.alone()
        before = memory(server)
        with bystander.watching() as seen, Peak(server) as peak:
            started = time.perf_counter()
            code, text = raw.status(raw.call(path, message(bombs[encoding], 1), header))
            elapsed = time.perf_counter() - started
            threading.Event().wait(max(0.0, 2.0 - elapsed))
        seen.check_health()
    raw.close()
    assert code == RESOURCE_EXHAUSTED and elapsed < 5
    assert text.startswith("Received message larger than max (")
    assert text.endswith(f" vs. {MAX_INFLATED})")
    assert peak.peak - before <= MAX_INFLATED + SLACK, (peak.peak - before) >> 20
    seen.p99_or_known_gap(
        alone, "inflating is the server's own work: it takes turns of about 100 us of the"
        " event loop between the bystander's calls",
    )  # fmt: skip


# -- bytes that are no ModelInferRequest --------------------------------------------------------
ZEROS = bytes(64 << 20)  # 64 MiB of field number 0
TINY = b"\x2a\x00" + b"\x3a\x00" * 10_000_000  # an input, then 10 million empty raw contents


def _invalid(channel: grpc.Channel, data: bytes) -> tuple[grpc.StatusCode, str, float]:
    call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
    started = time.perf_counter()
    try:
        call(data, timeout=60)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or "", time.perf_counter() - started
    raise AssertionError("answered OK")


def _attack(
    url: str, stop: multiprocessing.synchronize.Event, begun: multiprocessing.synchronize.Event,
    sent: multiprocessing.Value,
) -> None:  # fmt: skip
    """The attacker: a process of its own at the lowest priority, sending both in turn;
    ``begun`` once it has sent each."""
    os.nice(19)
    with grpc.insecure_channel(url) as channel:
        while not stop.is_set():
            for data in (ZEROS, TINY):
                code, _, _ = _invalid(channel, data)
                assert code == grpc.StatusCode.INVALID_ARGUMENT
                with sent.get_lock():
                    sent.value += 1
            begun.set()


@pytest.mark.parametrize(
    ("data", "what"),
    [(ZEROS, "malformed ModelInferRequest: field number 0 at byte 0"),
     (TINY, "malformed ModelInferRequest: more than 4096 fields (--grpc-infer-max-fields)")],
    ids=["zeros", "tiny-fields"],
)  # fmt: skip
def test_bytes_that_are_no_request_are_refused_quickly(
    server: RunningServer, data: bytes, what: str
) -> None:
    with grpc.insecure_channel(server.grpc_url) as channel:
        code, details, elapsed = _invalid(channel, data)
    assert (code, details) == (grpc.StatusCode.INVALID_ARGUMENT, what)
    assert elapsed < 2.0  # the bytes' transfer, then a few steps


def test_a_stream_answers_a_message_that_is_no_request_before_the_rest_arrives(
    server: RunningServer,
) -> None:
    """A stream's message of 1 GiB announced, its first 64 KiB sent, all zeros: its error
    comes back in the stream at once, the rest never sent nor waited for."""
    raw = RawGrpc(server.grpc_url)
    try:
        head = b"\x00" + (1 << 30).to_bytes(4, "big")
        stream = raw.call(STREAM_INFER, head + bytes(64 << 10), end=False)
        reply = pb.ModelStreamInferResponse.FromString(raw.first_data(stream, 10)[5:])
    finally:
        raw.close()
    assert reply.error_message == "malformed ModelInferRequest: field number 0 at byte 0"


def test_a_stream_answers_bytes_that_are_no_request_in_the_stream_and_goes_on(
    server: RunningServer,
) -> None:
    """The 64 MiB of zeros on ModelStreamInfer: their error comes back in the stream, and
    the stream's next request is served."""
    with grpc.insecure_channel(server.grpc_url) as channel:
        stream = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")
        replies = [
            pb.ModelStreamInferResponse.FromString(reply)
            for reply in stream(iter([ZEROS, VALID]), timeout=60)
        ]
    assert sorted(reply.error_message for reply in replies) == [
        "", "malformed ModelInferRequest: field number 0 at byte 0",
    ]  # fmt: skip
    [served] = [reply.infer_response for reply in replies if not reply.error_message]
    assert served.model_name == "identity_fp32" and served.raw_output_contents


def _attacked(url: str, bystander: Bystander, seconds: float = 3.0) -> Seen:
    """What the bystander sees while the attacker sends to ``url`` for ``seconds``."""
    context = multiprocessing.get_context("spawn")
    stop, begun, sent = context.Event(), context.Event(), context.Value("i", 0)
    attacker = context.Process(target=_attack, args=(url, stop, begun, sent))
    attacker.start()
    try:
        assert begun.wait(60)
        with bystander.watching() as seen:
            threading.Event().wait(seconds)
    finally:
        stop.set()
        attacker.join(60)
    assert attacker.exitcode == 0 and sent.value >= 4
    return seen


def test_others_are_served_while_an_attacker_sends_them_in_a_loop(server: RunningServer) -> None:
    """Each message is refused from its first bytes (``ArrivingRequest``), not gathered, so
    the server's share of the attack is small: the bystander's health checks stay within
    the bound. Its p99 against its p99 alone is reported as a known gap where the machine's
    cores miss it, with what the same attack at another server of the machine costs it."""
    with run_server(EXAMPLES) as elsewhere, Bystander(server.http_url, server.grpc_url) as seer:
        alone = seer.alone()
        control = p99(_attacked(elsewhere.grpc_url, seer).infer)
        seen = _attacked(server.grpc_url, seer)
    seen.check_health()
    seen.p99_or_known_gap(
        alone,
        "the attacking process (grpcio writing 64 MiB messages, the kernel copying them"
        " through loopback until the refusal reaches it) takes cores the bystander needs on"
        " a small machine, and the server reads what it drops, 256 KiB a turn of its loop"
        " and a turn a millisecond: the same attack at another server costs it (p99"
        f" {control * 1e3:.2f} ms)",
    )


# -- slow readers -------------------------------------------------------------------------------
STREAMS = 6  # streams of a slow reader: what they hold waiting for window passes the budget
SHARED_CPU = (
    "on 2 cores the slow reader's 100 requests run the model and copy 4 MiB outputs, work"
    " that shares the CPU with the bystander's calls"
)


def _settles_near(server: RunningServer, baseline: int, deadline_s: float = 30) -> int:
    """Memory once it is within 10% of ``baseline`` (or at the deadline)."""
    deadline = time.monotonic() + deadline_s
    while (now := memory(server)) > baseline * 1.1 and time.monotonic() < deadline:
        time.sleep(0.05)
    return now


def _never_read(server: RunningServer, streaming: bool) -> bool:
    """100 requests of 36 bytes for 4 MiB each on a connection that gives no window
    (unary: a call each; streaming: STREAMS streams of them); whether the server drops
    the connection within the send timeout (and some)."""
    request = message(sized_request())
    slow = RawGrpc(server.grpc_url, window=0)
    try:
        if streaming:
            for _ in range(STREAMS):
                slow.call(STREAM_INFER, request * 100, end=False)
        else:
            for _ in range(100):
                slow.call(INFER, request)
        return slow.closed_by_server(SEND_TIMEOUT_S + 30)
    finally:
        slow.close()


@pytest.mark.parametrize("streaming", [False, True], ids=["unary", "streaming"])
def test_a_reader_that_never_reads_holds_its_budget_then_is_dropped(
    slow_server: RunningServer, streaming: bool
) -> None:
    """The server holds about its send budget, not 400 MiB: the larger of the budget and
    the 16 calls a connection may run before its first response (a stream's requests
    count as its connection's calls), and a response or two on their way; after the send
    timeout the connection is dropped and the memory is back within 10%; other clients
    are served meanwhile. Measured the second time: the first makes the buffers such a
    reader uses (the worker's output arena, the server's copies)."""
    server = slow_server
    assert _never_read(server, streaming)
    with Bystander(server.http_url, server.grpc_url) as bystander:
        alone = bystander.alone()
        baseline = memory(server)
        with bystander.watching() as seen, Peak(server) as peak:
            assert _never_read(server, streaming)
        seen.check_health()
    bound = max(SEND_BUDGET, FIRST_CALLS * OUTPUT) + 2 * OUTPUT + SLACK
    assert peak.peak - baseline <= bound, (peak.peak - baseline) >> 20
    assert _settles_near(server, baseline) <= baseline * 1.1
    seen.p99_or_known_gap(alone, SHARED_CPU)


def test_what_a_stream_held_is_released_when_its_client_goes(server: RunningServer) -> None:
    """A stream whose client sends 24 MiB of requests (past its 16 MiB window) and never
    reads, then disconnects: six times over, the server's memory does not grow (measured
    after the first, which makes the buffers such a stream uses)."""
    tensor = pb.ModelInferRequest.InferInputTensor(
        name="INPUT0", datatype="FP32", shape=[1, 1 << 18]
    )  # fmt: skip
    request = message(pb.ModelInferRequest(
        model_name="identity_fp32", inputs=[tensor], raw_input_contents=[bytes(1 << 20)]
    ).SerializeToString())  # fmt: skip

    def one() -> None:
        slow = RawGrpc(server.grpc_url, window=0)
        try:
            slow.call(STREAM_INFER, request * 24, end=False)
        except OSError:
            pass  # a server that enforces its window may reset it first
        finally:
            slow.close()

    one()
    baseline = _settles_near(server, memory(server), deadline_s=1)
    for _ in range(5):
        one()
    assert _settles_near(server, baseline) <= baseline * 1.1


# -- the options ---------------------------------------------------------------------------------
def test_the_message_size_and_field_count_options(repository: Path) -> None:
    """--grpc-max-message-size and --grpc-infer-max-fields, as tritonclient sees them."""
    options = ("--grpc-max-message-size", "1000", "--grpc-infer-max-fields", "8")
    with run_server(repository, *options) as running:
        client = grpcclient.InferenceServerClient(running.grpc_url)
        tensor = grpcclient.InferInput("INPUT0", [1, 300], "FP32")
        tensor.set_data_from_numpy(np.zeros((1, 300), np.float32))
        with pytest.raises(grpcclient.InferenceServerException) as info:
            client.infer("identity_fp32", [tensor])
        assert info.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
        assert "Received message larger than max (" in info.value.message()
        assert info.value.message().endswith(" vs. 1000)")
        outputs = [grpcclient.InferRequestedOutput(f"O{i}") for i in range(8)]
        small = grpcclient.InferInput("INPUT0", [1, 4], "FP32")
        small.set_data_from_numpy(np.zeros((1, 4), np.float32))
        with pytest.raises(grpcclient.InferenceServerException) as info:
            client.infer("identity_fp32", [small], outputs=outputs)  # 10 fields
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert "more than 8 fields (--grpc-infer-max-fields)" in info.value.message()
        assert client.infer("identity_fp32", [small]).as_numpy("OUTPUT0") is not None
