"""BLS and decoupled models through a real server, driven by unmodified tritonclient.

- a BLS model (bls_pipeline) calling two models: synchronously, with async_exec, and with
  asyncio.gather; the callees' statistics count the calls (the same core path);
- BLS into a decoupled model (exec(decoupled=True), sync and async);
- zero copy between models: the caller passes its own input, which lives in the client's
  shared-memory region; the callee writes into it and the caller and the client see it;
- the callee's errors reach the caller's client; a call's timeout; circular calls;
- pb_utils.is_model_ready from a model.
"""

from __future__ import annotations

import os
import queue
import select
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from conftest import TEST_MODELS, RunningServer, repository_of, run_server

DEADLINE_S = 60.0
MODELS = ("double", "async_execute", "in_place", "raises", "gated", "repeat", "bls_pipeline",
          "bls_bounce", "cancellable")  # fmt: skip


@pytest.fixture(scope="module", params=["true", "false"], ids=["direct", "through-server"])
def server(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[RunningServer]:
    """Each test runs twice: with calls to plain models going straight to the callee's
    instance (the default), and with every call through the server (--bls-direct false)."""
    models = (TEST_MODELS / name for name in MODELS)
    repository = repository_of(tmp_path_factory.mktemp("bls_repo"), *models)
    with run_server(repository, "--bls-direct", request.param) as running:
        yield running


@pytest.fixture
def client(server: RunningServer) -> Iterator[grpcclient.InferenceServerClient]:
    with grpcclient.InferenceServerClient(server.grpc_url) as triton:
        yield triton


def fp32(name: str, values: np.ndarray) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(values.shape), "FP32")
    tensor.set_data_from_numpy(values.astype(np.float32))
    return tensor


def pipeline(
    client: grpcclient.InferenceServerClient, mode: str, x: np.ndarray, *extra: Any
) -> grpcclient.InferResult:
    return client.infer("bls_pipeline", [fp32("INPUT0", x), *extra], parameters={"mode": mode})


def inference_count(client: grpcclient.InferenceServerClient, model: str) -> int:
    stats = client.get_inference_statistics(model, as_json=True)
    return int(stats["model_stats"][0].get("inference_count", 0))


@pytest.mark.parametrize("size", [3, 150_000])  # large: the tensors travel by reference
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_bls_calls_two_models_in_turn(
    client: grpcclient.InferenceServerClient, mode: str, size: int
) -> None:
    x = np.linspace(-3, 3, size, dtype=np.float32)
    before = (inference_count(client, "double"), inference_count(client, "async_execute"))
    result = pipeline(client, mode, x)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x * 2 + 1)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), x * 2)
    after = (inference_count(client, "double"), inference_count(client, "async_execute"))
    assert after == (before[0] + 1, before[1] + 1)  # the calls are counted as requests


def test_bls_calls_two_models_at_once_with_gather(
    client: grpcclient.InferenceServerClient,
) -> None:
    x = np.arange(100_000, dtype=np.float32)  # large: the callees use their arenas
    result = pipeline(client, "gather", x)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x * 2)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), x + 1)


@pytest.mark.parametrize("mode", ["decoupled", "decoupled_async"])
def test_bls_into_a_decoupled_model(client: grpcclient.InferenceServerClient, mode: str) -> None:
    result = pipeline(client, mode, np.zeros(5, dtype=np.float32))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), [0, 1, 2, 3, 4])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), [6])  # 5, then the final flag


def test_callee_error_reaches_the_client(client: grpcclient.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException) as raised:
        pipeline(client, "error", np.ones(2))
    assert "raises: execute failed on purpose" in raised.value.message()
    with pytest.raises(InferenceServerException) as missing:
        pipeline(client, "missing", np.ones(2))
    expected = "Failed for execute the inference request. Model 'no_such_model' is not ready."
    assert expected in missing.value.message()  # Triton's words


@pytest.mark.parametrize("mode", ["itself", "bounce"])
def test_circular_call_fails_instead_of_hanging(
    client: grpcclient.InferenceServerClient, mode: str
) -> None:
    """bls_pipeline has one instance, and it waits for the call: a call into it from its
    own chain (itself, or through bls_bounce) could only wait for itself. Calls that an
    instance is left for are served (test_bls_triton.py)."""
    with pytest.raises(InferenceServerException) as raised:
        pipeline(client, mode, np.ones(2))
    message = raised.value.message()
    assert "circular BLS call" in message
    path = "bls_pipeline -> bls_pipeline" if mode == "itself" else "bls_pipeline -> bls_bounce"
    assert path in message
    assert "every instance of model 'bls_pipeline' (1) is already waiting" in message
    np.testing.assert_array_equal(pipeline(client, "sync", np.ones(1)).as_numpy("OUTPUT0"), [3])


def test_is_model_ready_from_a_model(client: grpcclient.InferenceServerClient) -> None:
    np.testing.assert_array_equal(pipeline(client, "ready", np.ones(1)).as_numpy("OUTPUT1"), [1, 0])


def test_call_timeout(client: grpcclient.InferenceServerClient, tmp_path: Path) -> None:
    """gated blocks until told to go; the caller's 0.2 s timeout passes meanwhile."""
    started, go = tmp_path / "started", tmp_path / "go"
    os.mkfifo(started)
    os.mkfifo(go)
    control = grpcclient.InferInput("CONTROL", [2], "BYTES")
    control.set_data_from_numpy(np.array([str(started).encode(), str(go).encode()], dtype=object))
    outcome: queue.Queue[BaseException | None] = queue.Queue()

    def call() -> None:
        try:
            pipeline(client, "timeout", np.ones(2), control)
            outcome.put(None)
        except BaseException as exc:
            outcome.put(exc)

    thread = threading.Thread(target=call)
    thread.start()
    with open(started) as fifo:  # gated is running: the call is in flight
        assert fifo.readline() == "started\n"
    error = outcome.get(timeout=DEADLINE_S)  # answered while gated still holds the request
    with open(go, "w") as fifo:
        fifo.write("go\n")
    thread.join(DEADLINE_S)
    assert isinstance(error, InferenceServerException)
    assert "Request timeout expired" in error.message()


def test_zero_copy_between_models(client: grpcclient.InferenceServerClient) -> None:
    """The client's input is in its shared-memory region; bls_pipeline passes that input on
    to in_place, which adds 1 to it in place: the caller reads the change in its own input
    and the client in its own region, so the callee wrote into the very same memory."""
    x = np.arange(1, 9, dtype=np.float32)
    key = f"/test_bls_{uuid.uuid4().hex[:8]}"
    handle = shm.create_shared_memory_region("bls_in", key, x.nbytes)
    try:
        shm.set_shared_memory_region(handle, [x])
        client.register_system_shared_memory("bls_in", key, x.nbytes)
        tensor = grpcclient.InferInput("INPUT0", [x.size], "FP32")
        tensor.set_shared_memory("bls_in", x.nbytes)
        result = client.infer("bls_pipeline", [tensor], parameters={"mode": "in_place"})
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), x + 1)  # the callee's view
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x + 1)  # the caller's input
        region = shm.get_contents_as_numpy(handle, np.float32, [x.size])
        np.testing.assert_array_equal(region, x + 1)  # the client's own memory
    finally:
        client.unregister_system_shared_memory("bls_in")
        shm.destroy_shared_memory_region(handle)


def test_zero_copy_of_the_caller_s_own_input(client: grpcclient.InferenceServerClient) -> None:
    """A large input reaches bls_pipeline in its input arena; passed on to in_place, which
    adds 1 to it in place, the caller then reads x + 1 in its own input: the callee got the
    caller's memory, not a copy. (The outputs come back as views of in_place's arena.)"""
    x = np.arange(200_000, dtype=np.float32)  # over the inline limit: in the arena
    for _ in range(3):  # the arenas' space is handed back and reused
        result = pipeline(client, "in_place", x)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x + 1)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), x + 1)


def _read_line(path: Path) -> str:
    """The first line a model writes into FIFO ``path``, waited for with a deadline."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        readable, _, _ = select.select([fd], [], [], DEADLINE_S)
        assert readable, f"nothing written to {path}"
        return os.read(fd, 64).decode()
    finally:
        os.close(fd)


def _gated_inputs(started: Path, go: Path) -> list[grpcclient.InferInput]:
    control = grpcclient.InferInput("CONTROL", [2], "BYTES")
    control.set_data_from_numpy(np.array([str(started).encode(), str(go).encode()], dtype=object))
    return [control, fp32("DATA", np.ones(2))]


def _failures(client: grpcclient.InferenceServerClient, model: str) -> int:
    stats = client.get_inference_statistics(model, as_json=True)["model_stats"][0]
    return int(stats["inference_stats"].get("fail", {}).get("count", 0))


def test_a_cancelled_request_that_waits_is_not_run(
    client: grpcclient.InferenceServerClient, tmp_path: Path
) -> None:
    """gated holds request 1; request 2 waits behind it, sent on a stream that its client
    then cancels; once request 1 goes, request 2 is skipped (it would block on its FIFO if
    it ran) and request 3 runs."""
    fifos = [tmp_path / f"{what}{i}" for i in (1, 2, 3) for what in ("started", "go")]
    for fifo in fifos:
        os.mkfifo(fifo)
    s1, g1, s2, g2, s3, g3 = fifos
    done: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.async_infer("gated", _gated_inputs(s1, g1),
                       lambda result, error: done.put((result, error)))  # fmt: skip
    assert _read_line(s1) == "started\n"  # request 1 holds the instance
    failures = _failures(client, "gated")
    streamed: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: streamed.put((result, error)))
    client.async_stream_infer("gated", _gated_inputs(s2, g2), request_id="waits")
    client.async_stream_infer("double", [fp32("INPUT0", np.ones(1))], request_id="after")
    result, error = streamed.get(timeout=DEADLINE_S)  # "after" is back: "waits" was read
    assert error is None and result.get_response().id == "after"
    client.stop_stream(cancel_requests=True)
    deadline = time.monotonic() + DEADLINE_S  # no event says the server saw it: ask
    while _failures(client, "gated") == failures:
        assert time.monotonic() < deadline, "the server never saw the cancellation"
        time.sleep(0.01)
    with open(g1, "w") as fifo:
        fifo.write("go\n")
    later: queue.Queue[Any] = queue.Queue()  # request 3's, apart: it may come before 1's
    third = threading.Thread(target=lambda: later.put(client.infer("gated", _gated_inputs(s3, g3))))
    third.start()
    assert _read_line(s3) == "started\n"  # request 2 was skipped: request 3 runs
    with open(g3, "w") as fifo:
        fifo.write("go\n")
    third.join(DEADLINE_S)
    first = done.get(timeout=DEADLINE_S)
    assert first[1] is None  # request 1 answered
    assert later.get(timeout=DEADLINE_S).get_response().id == ""  # and request 3


def test_model_control_from_a_model(test_server: RunningServer) -> None:
    """pb_utils.unload_model / load_model / is_model_ready (explicit model control)."""
    with grpcclient.InferenceServerClient(test_server.grpc_url) as explicit:
        result = pipeline(explicit, "reload", np.ones(2))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), [1, 0, 1])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), [2, 2])


def test_a_model_loads_another_from_files_it_sends(test_server: RunningServer) -> None:
    """pb_utils.load_model(name, config=..., files={"file:1/model.py": ...})."""
    with grpcclient.InferenceServerClient(test_server.grpc_url) as explicit:
        result = pipeline(explicit, "sent", np.array([1.0, 2.0]))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), [0, 1, 0])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), [3, 6])


def test_model_control_needs_explicit_mode(client: grpcclient.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException, match="explicit model load / unload"):
        pipeline(client, "reload", np.ones(2))


def test_an_executing_request_sees_its_client_go(
    client: grpcclient.InferenceServerClient, tmp_path: Path
) -> None:
    """cancellable waits in execute for is_cancelled(); the client cancels; the model sees
    it (the report that runs next counts it)."""
    started = tmp_path / "started"
    os.mkfifo(started)

    def path(value: str) -> list[grpcclient.InferInput]:
        tensor = grpcclient.InferInput("INPUT0", [1], "BYTES")
        tensor.set_data_from_numpy(np.array([value.encode()], dtype=object))
        return [tensor]

    before = int(client.infer("cancellable", path("report")).as_numpy("OUTPUT0")[0])
    running = client.async_infer("cancellable", path(str(started)), lambda result, error: None)
    assert _read_line(started) == "started\n"  # executing
    running.cancel()
    after = int(client.infer("cancellable", path("report")).as_numpy("OUTPUT0")[0])
    assert after == before + 1
