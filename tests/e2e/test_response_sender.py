"""The response sender of a model that is not decoupled (Triton 24.06 and later), through a
real server and real workers, driven by tritonclient over gRPC and HTTP.

Such a model sends exactly one response per request with ``request.get_response_sender()``
(the final flag with it or after it), before or after ``execute`` returns, or returns it;
Triton's rules hold, with its messages: the final flag before any response ("cannot send
complete final before sending a response"), a second response, or a response both sent and
returned ("cannot send more than one response"). While a request waits for a response its
model sends after ``execute`` returned, its instance takes other requests. A request that
nothing will answer fails with a message that says so, instead of waiting forever.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import TEST_MODELS, FifoGate, RunningServer, run_server

MODEL = "default_sender"
BATCHED = "default_sender_batched"
QUEUED = "default_sender_queued"  # requests wait in the server while its instance is busy
TIMEOUT_S = 60
FINAL_FIRST = (
    "Unable to send response. Non-decoupled model cannot send complete final before sending "
    "a response."
)
TWICE = "Unable to send response. Non-decoupled model cannot send more than one response."
INTERNAL = ("StatusCode.INTERNAL", "500")  # Triton's status for these: INTERNAL

BATCHED_CONFIG = """
backend: "python"
max_batch_size: 8
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
dynamic_batching { preferred_batch_size: [ 2 ] max_queue_delay_microseconds: 60000000 }
instance_group [ { count: 1 kind: KIND_CPU } ]
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    repository = tmp_path_factory.mktemp("sender_repo")
    shutil.copytree(TEST_MODELS / MODEL, repository / MODEL)
    shutil.copytree(TEST_MODELS / MODEL, repository / BATCHED)
    (repository / BATCHED / "config.pbtxt").write_text(BATCHED_CONFIG)
    shutil.copytree(TEST_MODELS / MODEL, repository / QUEUED)
    with open(repository / QUEUED / "config.pbtxt", "a") as config:
        config.write("dynamic_batching { }\n")  # one request per execute, none waits at it
    shutil.copytree(TEST_MODELS / "sender_relay", repository / "sender_relay")
    with run_server(repository) as running:
        yield running


Infer = Callable[..., int]


def grpc_infer(
    server: RunningServer, mode: str, value: int = 1, model: str = MODEL, **params: str
) -> int:
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        tensor = grpcclient.InferInput("IN", [1], "INT32")
        tensor.set_data_from_numpy(np.array([value], np.int32))
        result = client.infer(model, [tensor], parameters={"mode": mode, **params},
                              client_timeout=TIMEOUT_S)  # fmt: skip
        return int(result.as_numpy("OUT")[0])


def http_infer(
    server: RunningServer, mode: str, value: int = 1, model: str = MODEL, **params: str
) -> int:
    with httpclient.InferenceServerClient(server.http_url, network_timeout=TIMEOUT_S) as client:
        tensor = httpclient.InferInput("IN", [1], "INT32")
        tensor.set_data_from_numpy(np.array([value], np.int32))
        result = client.infer(model, [tensor], parameters={"mode": mode, **params})
        return int(result.as_numpy("OUT")[0])


@pytest.fixture(params=["grpc", "http"])
def infer(request: pytest.FixtureRequest, server: RunningServer) -> Infer:
    call = grpc_infer if request.param == "grpc" else http_infer

    def run(mode: str, value: int = 1, model: str = MODEL, **params: str) -> int:
        return call(server, mode, value, model, **params)

    return run


def failure(call: Callable[[], Any]) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as caught:
        call()
    assert caught.value.status() in INTERNAL
    return caught.value


@pytest.mark.parametrize("mode", ["send", "send_then_final", "send_without_final"])
def test_one_response_sent_before_execute_returns(infer: Infer, mode: str) -> None:
    assert infer(mode, 4) == 41


def test_a_returned_response_still_works(infer: Infer) -> None:
    assert infer("return", 4) == 43


def test_final_flag_before_any_response_is_refused(infer: Infer) -> None:
    error = failure(lambda: infer("final_first"))
    assert FINAL_FIRST in error.message()


def test_final_flag_refused_in_execute_then_none_returned_ends_with_tritons_message(
    infer: Infer,
) -> None:
    """The model catches the refusal and returns None: nothing will answer the request, and
    its error says why (not a wait for the sender to be collected)."""
    error = failure(lambda: infer("final_first_caught"))
    assert FINAL_FIRST in error.message()


def test_second_response_is_refused_and_the_first_stands(infer: Infer, tmp_path: Path) -> None:
    note = tmp_path / "note"
    assert infer("twice", 5, note=str(note)) == 51  # the exception ended execute
    assert note.read_text() == f"{TWICE}\n"  # what the model's second send() raised


def test_sent_and_returned_the_sent_one_stands(infer: Infer) -> None:
    assert infer("send_and_return", 6) == 61


def test_sent_and_returned_fails_the_rest_of_the_batch_with_tritons_message(
    server: RunningServer,
) -> None:
    """Triton checks the returned responses against the senders: one request's response
    both sent and returned fails the whole execute (the sent one stands)."""
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        results: dict[str, Any] = {}
        done = [concurrent.futures.Future[None]() for _ in range(2)]
        for index, mode in enumerate(["send_and_return", "return"]):
            tensor = grpcclient.InferInput("IN", [1, 1], "INT32")
            tensor.set_data_from_numpy(np.array([[index + 1]], np.int32))

            def callback(result: Any, error: Any, mode: str = mode, index: int = index) -> None:
                results[mode] = result if error is None else error
                done[index].set_result(None)

            client.async_infer(BATCHED, [tensor], callback, parameters={"mode": mode})
        concurrent.futures.wait(done, timeout=TIMEOUT_S)
    assert int(results["send_and_return"].as_numpy("OUT")[0][0]) == 11
    assert isinstance(results["return"], InferenceServerException)
    assert TWICE in results["return"].message()
    assert results["return"].status() == "StatusCode.INTERNAL"


def test_nothing_sent_nothing_returned_fails_at_once(infer: Infer) -> None:
    for mode in ("nothing", "drop"):
        error = failure(lambda mode=mode: infer(mode))  # type: ignore[misc]
        assert "sent no response for a request" in error.message()
        assert "execute returned None in its place" in error.message()


def late(
    server: RunningServer, infer: Infer, mode: str, value: int, model: str = QUEUED,
    **params: str,
) -> concurrent.futures.Future[int]:  # fmt: skip
    """Start a request whose model answers from a thread once its gate opens; once its
    execute has begun, show that its instance serves others meanwhile (its execute has
    returned, and the server knows it: ``model`` keeps waiting requests in the server, and
    its one instance takes them after that execute); then open the gate."""
    gate = FifoGate(Path(params.pop("folder")))
    pool = concurrent.futures.ThreadPoolExecutor(3)
    waiting = pool.submit(infer, mode, value, model, gate=str(gate.go),
                          started=str(gate.started), **params)  # fmt: skip
    gate.wait_started()  # else the others may go first, and the thread answer before return
    others = [pool.submit(grpc_infer, server, "return", 7, model) for _ in range(2)]
    assert [other.result(TIMEOUT_S) for other in others] == [73, 73]
    gate.open()
    pool.shutdown(wait=False)
    return waiting


@pytest.mark.parametrize("mode", ["later", "later_then_final"])
def test_one_response_sent_after_execute_returned(
    server: RunningServer, infer: Infer, mode: str, tmp_path: Path
) -> None:
    assert late(server, infer, mode, 8, folder=str(tmp_path)).result(TIMEOUT_S) == 81


def test_final_flag_first_after_return_ends_the_request_with_tritons_message(
    server: RunningServer, infer: Infer, tmp_path: Path
) -> None:
    note = tmp_path / "note"
    os.mkfifo(note)
    waiting = late(server, infer, "final_first_later", 1, folder=str(tmp_path), note=str(note))
    error = failure(lambda: waiting.result(TIMEOUT_S))
    assert FINAL_FIRST in error.message()  # Triton leaves such a request unanswered
    with open(note) as raised:  # the model's send() raised it too
        assert raised.readline() == f"{FINAL_FIRST}\n"


def test_second_response_after_return_is_refused(
    server: RunningServer, infer: Infer, tmp_path: Path
) -> None:
    note = tmp_path / "note"
    os.mkfifo(note)
    waiting = late(server, infer, "twice_later", 2, folder=str(tmp_path), note=str(note))
    assert waiting.result(TIMEOUT_S) == 21
    with open(note) as raised:
        assert raised.readline() == f"{TWICE}\n"


def test_returned_then_sent_after_return_is_refused(
    server: RunningServer, infer: Infer, tmp_path: Path
) -> None:
    note = tmp_path / "note"
    os.mkfifo(note)
    waiting = late(server, infer, "return_and_send_later", 3, folder=str(tmp_path),
                   note=str(note))  # fmt: skip
    assert waiting.result(TIMEOUT_S) == 33
    with open(note) as raised:
        assert raised.readline() == f"{TWICE}\n"


def test_a_sender_released_unanswered_ends_its_request(
    server: RunningServer, infer: Infer, tmp_path: Path
) -> None:
    waiting = late(server, infer, "drop_later", 1, folder=str(tmp_path))
    error = failure(lambda: waiting.result(TIMEOUT_S))
    assert "its response sender was released without sending one" in error.message()


def relay_infer(server: RunningServer, mode: str, value: int = 1, **params: str) -> int:
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        tensor = grpcclient.InferInput("IN", [1], "INT32")
        tensor.set_data_from_numpy(np.array([value], np.int32))
        result = client.infer("sender_relay", [tensor], parameters={"mode": mode, **params},
                              client_timeout=TIMEOUT_S)  # fmt: skip
        return int(result.as_numpy("OUT")[0])


@pytest.mark.parametrize("through", ["direct", "server"])
def test_bls_caller_gets_a_response_sent_after_return(
    server: RunningServer, through: str, tmp_path: Path
) -> None:
    """A BLS call to such a model, straight to its instance or through the server, gets
    the response its thread sends after execute returned."""

    def relay(mode: str, value: int = 1, model: str = "", **params: str) -> int:
        return relay_infer(server, mode, value, through=through, **params)

    waiting = late(server, relay, "later", 9, MODEL, folder=str(tmp_path))
    assert waiting.result(TIMEOUT_S) == 91
