"""Graceful stop under load: SIGTERM while 64 clients (32 gRPC, 32 HTTP) have requests
accepted by the server (one executing, 63 queued behind it at a model that holds them).

The listeners close at once (a new connection is refused while the held requests still
wait), every accepted request then gets its correct answer, and the process exits 0.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from conftest import TEST_MODELS, run_server, wait_pending

CLIENTS = 64


def _inputs(module: object, started: Path, go: Path, value: float) -> list[object]:
    control = module.InferInput("CONTROL", [2], "BYTES")  # type: ignore[attr-defined]
    control.set_data_from_numpy(np.array([str(started).encode(), str(go).encode()], np.object_))
    data = module.InferInput("DATA", [1], "FP32")  # type: ignore[attr-defined]
    data.set_data_from_numpy(np.array([value], dtype=np.float32))
    return [control, data]


def _grpc_client(url: str) -> grpcclient.InferenceServerClient:
    """A client on a connection of its own: gRPC shares one connection between a process's
    channels to a target, and a connection runs at most 16 calls before its first
    response (docs/network-edge.md); these clients are 32 connections, as 32 processes'."""
    return grpcclient.InferenceServerClient(
        url, channel_args=[("grpc.use_local_subchannel_pool", 1)]
    )


def _refused(port: int) -> bool:
    """Whether a new connection is refused; one reset is refused too (it reached the
    listener's backlog as the listener closed)."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except (ConnectionRefusedError, ConnectionResetError):
        return True
    return False


def _release_one(started: Path, go: Path) -> None:
    """The gated model's handshake for one request: read its "started", write its "go"."""
    with open(started) as fifo:  # blocks until execute opens it
        assert fifo.readline() == "started\n"
    with open(go, "w") as fifo:
        fifo.write("go\n")


def test_sigterm_under_64_clients_answers_every_accepted_request(tmp_path: Path) -> None:
    started, go = tmp_path / "started", tmp_path / "go"
    os.mkfifo(started)
    os.mkfifo(go)
    extra = ("--model-control-mode", "explicit", "--load-model", "gated")
    with run_server(TEST_MODELS, *extra, "--exit-timeout-secs", "60") as s:
        results: queue.Queue[tuple[int, object]] = queue.Queue()
        grpc_clients = [_grpc_client(s.grpc_url) for _ in range(CLIENTS // 2)]
        http_client = httpclient.InferenceServerClient(s.http_url, concurrency=CLIENTS // 2)
        http_pending = []
        for i, client in enumerate(grpc_clients):
            client.async_infer(
                "gated",
                _inputs(grpcclient, started, go, float(i)),  # type: ignore[arg-type]
                lambda result, error, i=i: results.put((i, error or result)),
            )
        for i in range(CLIENTS // 2, CLIENTS):
            inputs = _inputs(httpclient, started, go, float(i))
            http_pending.append((i, http_client.async_infer("gated", inputs)))  # type: ignore[arg-type]
        # One request executes (held at its "go"), the other 63 wait in the model's queue.
        wait_pending(s, "gated", CLIENTS - 1)
        sent = time.monotonic()
        s.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while not (_refused(s.http_port) and _refused(s.grpc_port)):
            assert time.monotonic() < deadline, "the listeners are still open after SIGTERM"
        for _ in range(CLIENTS):
            _release_one(started, go)
        answers: dict[int, object] = dict(results.get(timeout=60) for _ in range(CLIENTS // 2))
        for i, pending in http_pending:
            answers[i] = pending.get_result()
        assert s.process.wait(timeout=60) == 0
        took = time.monotonic() - sent
        for i, answer in sorted(answers.items()):
            assert not isinstance(answer, Exception), (i, answer)
            assert answer.as_numpy("OUTPUT0").tolist() == [2.0 * i], i  # type: ignore[attr-defined]
        assert len(answers) == CLIENTS
        print(f"{CLIENTS} accepted requests answered after SIGTERM; exited 0 in {took:.2f} s")
        for client in grpc_clients:
            client.close()
        http_client.close()


def test_sigterm_under_64_clients_past_the_exit_timeout_ends_them_with_errors(
    tmp_path: Path,
) -> None:
    """The held requests never finish: at --exit-timeout-secs the server exits anyway and
    every accepted request gets an error instead of a hang."""
    started, never = tmp_path / "started", tmp_path / "never"
    os.mkfifo(started)
    os.mkfifo(never)
    timeout_s = 2
    extra = ("--model-control-mode", "explicit", "--load-model", "gated")
    with run_server(TEST_MODELS, *extra, "--exit-timeout-secs", str(timeout_s)) as s:
        results: queue.Queue[tuple[int, object]] = queue.Queue()
        grpc_clients = [_grpc_client(s.grpc_url) for _ in range(CLIENTS // 2)]
        http_client = httpclient.InferenceServerClient(s.http_url, concurrency=CLIENTS // 2)
        http_pending = []
        for i, client in enumerate(grpc_clients):
            client.async_infer(
                "gated",
                _inputs(grpcclient, started, never, float(i)),  # type: ignore[arg-type]
                lambda result, error, i=i: results.put((i, error or result)),
            )
        for i in range(CLIENTS // 2, CLIENTS):
            inputs = _inputs(httpclient, started, never, float(i))
            http_pending.append((i, http_client.async_infer("gated", inputs)))  # type: ignore[arg-type]
        wait_pending(s, "gated", CLIENTS - 1)
        fd = os.open(started, os.O_RDONLY | os.O_NONBLOCK)  # let the first reach its wait
        sent = time.monotonic()
        s.process.send_signal(signal.SIGTERM)
        code = s.process.wait(timeout=timeout_s + 30)
        took = time.monotonic() - sent
        os.close(fd)
        answers: dict[int, object] = dict(results.get(timeout=30) for _ in range(CLIENTS // 2))
        for i, pending in http_pending:
            try:
                answers[i] = pending.get_result()
            except Exception as exc:  # the error is what is asserted
                answers[i] = exc
        errors = {str(answer)[:120] for answer in answers.values()}
        print(f"exit code {code} after {took:.2f} s (timeout {timeout_s} s); errors: {errors}")
        assert all(isinstance(answer, Exception) for answer in answers.values()), errors
        assert took < timeout_s + 3, f"shutdown took {took:.1f} s"
        for client in grpc_clients:
            client.close()
        http_client.close()
