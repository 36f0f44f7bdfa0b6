"""Flow control of a decoupled model's responses (real server, real clients, real workers).

The ``flood`` model sends COUNT responses of SIZE bytes from a thread as fast as
``send()`` returns, and reports through gauges (polled on the metrics endpoint, the only
status a model can publish) how many sends returned, whether it saw ``is_cancelled()`` and
whether its final flag went out.

- a gRPC stream client (tritonclient) whose callback does not return: the model's sends
  stop (a plateau far below COUNT) and the server's RSS stays bounded; then the client
  reads on and gets every response, intact and in order, and the final flag;
- a raw grpc client that never reads and cancels its call: the held send is released,
  the model sees ``is_cancelled()`` and sends its final flag;
- HTTP generate_stream with a client that does not read: the same plateau, then every event;
- a BLS caller is not given a window (it is model code in this server; a window could
  deadlock a caller that reads its calls out of order): one that reads later gets
  everything, one that reads its second call to a single-instance callee first completes,
  and one that cancels its iterator releases the callee (it sees ``is_cancelled()``);
- a generate_stream client that goes away while the send is held: the model sees
  ``is_cancelled()``;
- a worker killed while its send is held ends the stream with the worker's error, and the
  restarted instance serves the next request;
- unloading a model waits for a stream whose client reads slowly (nothing is lost), and
  ends one nobody reads with an error after ``--exit-timeout-secs`` (no hang).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import queue
import shutil
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2, service_pb2_grpc

from conftest import TEST_MODELS, RunningServer, run_server

DEADLINE_S = 120.0
MIB = 1024 * 1024
COUNT = 256  # 256 MiB in all: what the server would hold without flow control
AHEAD = 64  # sends that may return before the client reads (windows and buffers on the way)
RSS_BOUND_MIB = 64  # growth of the server's RSS while the client does not read
STEADY_POLLS = 20  # a plateau: the same count on this many polls in a row
POLL_S = 0.05


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    repository = tmp_path_factory.mktemp("flow_repo")
    for name in ("flood", "flood_caller"):
        shutil.copytree(TEST_MODELS / name, repository / name)
    with run_server(repository) as running:
        yield running


def gauges(server: RunningServer, tag: str) -> dict[str, float]:
    """The flood model's gauges for requests tagged ``tag``."""
    with urllib.request.urlopen(server.metrics_url, timeout=DEADLINE_S) as reply:
        text = reply.read().decode()
    found: dict[str, float] = {}
    for line in text.splitlines():
        family = line.split("{", 1)[0]
        if family.startswith("flood_") and f'request="{tag}"' in line:
            found[family] = float(line.rsplit(" ", 1)[1])
    return found


def rss_mib(server: RunningServer) -> float:
    with open(f"/proc/{server.process.pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def plateau(server: RunningServer, tag: str) -> tuple[int, float]:
    """Poll the model's send count until it stops moving (there is no event for a send
    that waits): the count then, and the server's peak RSS meanwhile."""
    deadline = time.monotonic() + DEADLINE_S
    last, steady, peak = -1, 0, 0.0
    while time.monotonic() < deadline:
        peak = max(peak, rss_mib(server))
        sent = int(gauges(server, tag).get("flood_sent", 0))
        steady = steady + 1 if sent == last and sent > 0 else 0
        if steady >= STEADY_POLLS:
            return sent, peak
        last = sent
        time.sleep(POLL_S)
    raise AssertionError(f"the model's sends did not settle (last count {last})")


def wait_for(server: RunningServer, tag: str, family: str) -> dict[str, float]:
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        found = gauges(server, tag)
        if found.get(family) == 1:
            return found
        time.sleep(POLL_S)
    raise AssertionError(f"{family} never reached 1 for {tag}")


def flood_inputs(count: int, size: int) -> list[grpcclient.InferInput]:
    tensors = []
    for name, value in (("COUNT", count), ("SIZE", size)):
        tensor = grpcclient.InferInput(name, [1], "INT32")
        tensor.set_data_from_numpy(np.array([value], dtype=np.int32))
        tensors.append(tensor)
    return tensors


def check_response(index: int, output: Any, size: int) -> None:
    assert output.shape == (size,) and output.dtype == np.uint8
    assert int(output[0]) == int(output[-1]) == index % 256 and np.all(output == index % 256)


def test_a_stream_client_that_does_not_read_holds_the_model_back(server: RunningServer) -> None:
    gate = threading.Event()
    results: queue.Queue[tuple[Any, Any]] = queue.Queue()

    def callback(result: Any, error: Any) -> None:
        gate.wait(DEADLINE_S)  # the client's reading thread stops here: it reads nothing
        results.put((result, error))

    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.start_stream(callback=callback)
        try:
            before = rss_mib(server)
            client.async_stream_infer("flood", flood_inputs(COUNT, MIB), request_id="slow",
                                      enable_empty_final_response=True)  # fmt: skip
            sent, peak = plateau(server, "slow")
            print(f"client not reading: {sent} of {COUNT} sends of 1 MiB returned; server RSS "
                  f"{before:.0f} -> peak {peak:.0f} MiB (+{peak - before:.0f})")  # fmt: skip
            assert sent <= AHEAD
            assert peak - before < RSS_BOUND_MIB
            gate.set()
            received = [results.get(timeout=DEADLINE_S) for _ in range(COUNT + 1)]
        finally:
            gate.set()
            client.stop_stream()
    assert all(error is None for _, error in received)
    for index, (result, _) in enumerate(received[:COUNT]):
        assert int(result.as_numpy("INDEX")[0]) == index
        check_response(index, result.as_numpy("OUTPUT0"), MIB)
    final = received[COUNT][0].get_response()
    assert final.parameters["triton_final_response"].bool_param and not final.outputs
    found = gauges(server, "slow")
    assert (found["flood_sent"], found["flood_cancelled"], found["flood_done"]) == (COUNT, 0, 1)


def raw_request(tag: str, count: int, size: int) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="flood", id=tag)
    for name, value in (("COUNT", count), ("SIZE", size)):
        tensor = request.inputs.add(name=name, datatype="INT32", shape=[1])
        tensor.contents.int_contents.append(value)
    return request


def test_cancelling_a_stream_releases_a_held_send(server: RunningServer) -> None:
    keep_open = threading.Event()

    def requests() -> Iterator[service_pb2.ModelInferRequest]:
        yield raw_request("cancel", COUNT, MIB)
        keep_open.wait(DEADLINE_S)  # the request side stays open; nothing is read

    with grpc.insecure_channel(server.grpc_url) as channel:
        call = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(requests())
        try:
            sent, _ = plateau(server, "cancel")
            call.cancel()
        finally:
            keep_open.set()
    found = wait_for(server, "cancel", "flood_done")
    print(f"cancelled with {sent} sends returned: {found}")
    assert found["flood_cancelled"] == 1 and found["flood_sent"] < COUNT


def test_generate_stream_client_that_does_not_read(server: RunningServer) -> None:
    count, size = 150, 256 * 1024  # JSON events of ~900 KB: the socket buffers hold some
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=DEADLINE_S)
    body = {"COUNT": count, "SIZE": size, "parameters": {"tag": "sse"}}
    connection.request("POST", "/v2/models/flood/generate_stream", json.dumps(body))
    try:
        response = connection.getresponse()
        assert response.status == 200
        sent, _ = plateau(server, "sse")
        print(f"generate_stream client not reading: {sent} of {count} sends returned")
        assert sent < count // 2
        events = [json.loads(line[len(b"data: ") :]) for line in response.read().splitlines()
                  if line.startswith(b"data: ")]  # fmt: skip
    finally:
        connection.close()
    assert [event["INDEX"] for event in events] == list(range(count))
    for index, event in enumerate(events):
        check_response(index, np.array(event["OUTPUT0"], dtype=np.uint8), size)
    assert wait_for(server, "sse", "flood_done")["flood_sent"] == count


def test_a_generate_stream_client_that_goes_away_releases_the_held_send(
    server: RunningServer,
) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=DEADLINE_S)
    body = {"COUNT": COUNT, "SIZE": 256 * 1024, "parameters": {"tag": "sse-gone"}}
    connection.request("POST", "/v2/models/flood/generate_stream", json.dumps(body))
    try:
        assert connection.getresponse().status == 200
        sent, _ = plateau(server, "sse-gone")
        assert sent < COUNT
    finally:
        assert connection.sock is not None
        connection.sock.close()  # gone, with the model's send held
        connection.close()
    found = wait_for(server, "sse-gone", "flood_done")
    assert found["flood_cancelled"] == 1 and found["flood_sent"] < COUNT


def test_a_bls_caller_that_reads_later_does_not_hold_the_callee_back(
    server: RunningServer, tmp_path: Path
) -> None:
    """Unlike a network client, a BLS caller is not given a window: the callee sends all it has
    while the caller reads nothing (server/core/calls/bls_router.py says why), and the caller then
    gets
    every response, intact and in order."""
    called, go = tmp_path / "called", tmp_path / "go"
    os.mkfifo(called)
    os.mkfifo(go)
    inputs = flood_inputs(COUNT, 64 * 1024)
    control = grpcclient.InferInput("CONTROL", [2], "BYTES")
    control.set_data_from_numpy(np.array([str(called).encode(), str(go).encode()], dtype=object))
    results: queue.Queue[tuple[Any, Any]] = queue.Queue()
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.async_infer("flood_caller", [*inputs, control], request_id="c",
                           callback=lambda result, error: results.put((result, error)))  # fmt: skip
        with open(called) as fifo:
            assert fifo.readline() == "called\n"  # the call is made; nothing is taken yet
        found = wait_for(server, "bls-c", "flood_done")  # every send returned meanwhile
        assert found["flood_sent"] == COUNT
        with open(go, "w") as fifo:
            fifo.write("go\n")
        result, error = results.get(timeout=DEADLINE_S)
    assert error is None
    assert int(result.as_numpy("RECEIVED")[0]) == COUNT
    assert int(result.as_numpy("INTACT")[0]) == 1


def test_a_bls_caller_that_reads_its_second_call_first_completes(
    server: RunningServer,
) -> None:
    """Two calls to one single-instance callee that sends from execute, read in reverse: the
    second call runs only after the first one's execute has sent all of its responses,
    which the caller takes only after the second's. A window per call would wait forever
    (the first call more than a window ahead of its reader); Triton's unbounded queue does
    not, and neither does dlserve."""
    reverse = grpcclient.InferInput("REVERSE", [1], "INT32")
    reverse.set_data_from_numpy(np.array([1], dtype=np.int32))
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        result = client.infer("flood_caller", [*flood_inputs(200, 1024), reverse],
                              request_id="r", client_timeout=DEADLINE_S)  # fmt: skip
    assert int(result.as_numpy("RECEIVED")[0]) == 400
    assert int(result.as_numpy("INTACT")[0]) == 1


def test_a_bls_caller_that_cancels_its_iterator_releases_the_callee(
    server: RunningServer,
) -> None:
    take = grpcclient.InferInput("TAKE", [1], "INT32")
    take.set_data_from_numpy(np.array([3], dtype=np.int32))
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        result = client.infer("flood_caller", [*flood_inputs(COUNT, MIB), take], request_id="t")
    assert int(result.as_numpy("RECEIVED")[0]) == 3
    found = wait_for(server, "bls-t", "flood_done")  # the callee's held send let go
    assert found["flood_cancelled"] == 1 and found["flood_sent"] < COUNT


def test_a_worker_killed_while_its_send_is_held(server: RunningServer) -> None:
    keep_open = threading.Event()

    def requests() -> Iterator[service_pb2.ModelInferRequest]:
        yield raw_request("killed", COUNT, MIB)
        keep_open.wait(DEADLINE_S)

    with grpc.insecure_channel(server.grpc_url) as channel:
        call = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(requests())
        try:
            sent, _ = plateau(server, "killed")
            os.kill(int(gauges(server, "killed")["flood_pid"]), signal.SIGKILL)
            received = 0
            for message in call:  # the responses already on their way, then the error
                if message.error_message:
                    assert message.error_message == (
                        "Stub process 'flood_0_0' is not healthy. "
                        "Its process was killed by signal 9 (SIGKILL)."
                    )
                    break
                received += 1
        finally:
            keep_open.set()
            call.cancel()
    assert received <= sent < COUNT
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        deadline = time.monotonic() + DEADLINE_S
        while not client.is_model_ready("flood"):  # a restart takes as long as it takes
            assert time.monotonic() < deadline, "flood not ready again"
            time.sleep(POLL_S)
        results: queue.Queue[tuple[Any, Any]] = queue.Queue()
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        try:
            client.async_stream_infer("flood", flood_inputs(3, 16), request_id="after")
            after = [results.get(timeout=DEADLINE_S) for _ in range(3)]
        finally:
            client.stop_stream()
    assert [int(r.as_numpy("INDEX")[0]) for r, e in after if e is None] == [0, 1, 2]


def explicit_flood(root: Path, *extra: str) -> contextlib.AbstractContextManager[RunningServer]:
    shutil.copytree(TEST_MODELS / "flood", root / "flood")
    return run_server(root, "--model-control-mode", "explicit", "--load-model", "flood", *extra)


def test_unloading_waits_for_a_slow_reader_and_loses_nothing(tmp_path: Path) -> None:
    count = 64
    gate = threading.Event()
    results: queue.Queue[tuple[Any, Any]] = queue.Queue()

    def callback(result: Any, error: Any) -> None:
        gate.wait(DEADLINE_S)
        results.put((result, error))

    with explicit_flood(tmp_path) as srv, grpcclient.InferenceServerClient(srv.grpc_url) as client:
        client.start_stream(callback=callback)
        try:
            client.async_stream_infer("flood", flood_inputs(count, MIB), request_id="unload-slow",
                                      enable_empty_final_response=True)  # fmt: skip
            plateau(srv, "unload-slow")
            unloaded: list[BaseException | None] = []

            def unload() -> None:
                try:
                    with grpcclient.InferenceServerClient(srv.grpc_url) as other:
                        other.unload_model("flood")
                    unloaded.append(None)
                except BaseException as exc:
                    unloaded.append(exc)

            unloader = threading.Thread(target=unload)
            unloader.start()  # it waits for the stream; the client reads on meanwhile
            gate.set()
            received = [results.get(timeout=DEADLINE_S) for _ in range(count + 1)]
            unloader.join(DEADLINE_S)
        finally:
            gate.set()
            client.stop_stream()
        assert unloaded == [None] and not client.is_model_ready("flood")
    assert all(error is None for _, error in received)
    for index, (result, _) in enumerate(received[:count]):
        assert int(result.as_numpy("INDEX")[0]) == index
        check_response(index, result.as_numpy("OUTPUT0"), MIB)
    assert received[count][0].get_response().parameters["triton_final_response"].bool_param


def test_unloading_ends_a_stream_nobody_reads_after_the_exit_timeout(tmp_path: Path) -> None:
    with explicit_flood(tmp_path, "--exit-timeout-secs", "2") as srv:
        keep_open = threading.Event()

        def requests() -> Iterator[service_pb2.ModelInferRequest]:
            yield raw_request("unload", COUNT, MIB)
            keep_open.wait(DEADLINE_S)

        with grpc.insecure_channel(srv.grpc_url) as channel:
            call = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(requests())
            try:
                sent, _ = plateau(srv, "unload")
                started = time.monotonic()
                with grpcclient.InferenceServerClient(srv.grpc_url) as client:
                    client.unload_model("flood")
                    took = time.monotonic() - started
                    assert not client.is_model_ready("flood")
                received, error = 0, ""
                for message in call:  # what was on its way, then the error
                    if message.error_message:
                        error = message.error_message
                        break
                    received += 1
            finally:
                keep_open.set()
                call.cancel()
        found = gauges(srv, "unload")
    print(f"unloaded in {took:.2f} s (exit timeout 2 s); the stream got {received} of {sent} "
          f"responses sent, then: {error}")  # fmt: skip
    assert error == "model 'flood' is being unloaded"
    assert received <= sent < COUNT
    assert took < 2 + 10  # the exit timeout, then the held send let go at once
    assert found["flood_cancelled"] == 1 and found["flood_done"] == 1
