"""Shared fixtures: real dlserve servers started as subprocesses on free ports."""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "models"
TEST_MODELS = ROOT / "tests" / "models"
STARTUP_DEADLINE_S = 120.0
# the folders whose tests start servers (tests/README.md)
END_TO_END = ("e2e", "client", "deploy", "doctor")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the end-to-end tier ``e2e``: ``-m e2e`` selects it, ``-m "not e2e"`` the others."""
    tests = ROOT / "tests"
    for item in items:
        if item.path.is_relative_to(tests) and item.path.relative_to(tests).parts[0] in END_TO_END:
            item.add_marker(pytest.mark.e2e)


@dataclass
class RunningServer:
    process: subprocess.Popen[bytes]
    http_port: int
    grpc_port: int
    metrics_port: int
    repository: Path

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def alive(self) -> bool:
        return self.process.poll() is None


def repository_of(root: Path, *models: Path) -> Path:
    """A model repository at ``root`` holding copies of ``models`` (model folders)."""
    for model in models:
        shutil.copytree(model, root / model.name)
    return root


def _read_ready(process: subprocess.Popen[bytes], read_fd: int, deadline: float) -> dict[str, int]:
    """Block until the server writes its ports on the ready pipe (its startup handshake)."""
    chunks = b""
    while not chunks.endswith(b"\n"):
        remaining = deadline - time.monotonic()
        readable, _, _ = select.select([read_fd], [], [], max(remaining, 0))
        if not readable:
            raise TimeoutError("dlserve did not start in time")
        chunk = os.read(read_fd, 4096)
        if not chunk:
            raise RuntimeError(f"dlserve exited during startup (code {process.wait()})")
        chunks += chunk
    ports: dict[str, int] = json.loads(chunks)
    return ports


@contextlib.contextmanager
def run_server(
    repository: Path,
    *extra: str,
    env: dict[str, str] | None = None,
    new_session: bool = False,
    prefix: tuple[str, ...] = (),
) -> Iterator[RunningServer]:
    """Start dlserve on free ports; ready when it says so on the ready pipe.
    ``new_session``: in a process group of its own (a test may signal the whole group).
    ``prefix``: a command that execs the server (``unshare ...``), keeping its descriptors."""
    read_fd, write_fd = os.pipe()
    command = [
        *prefix,
        sys.executable,
        "-m",
        "dlserve",
        "serve",
        "--model-repository",
        str(repository),
        "--http-port",
        "0",
        "--grpc-port",
        "0",
        "--metrics-port",
        "0",
        "--ready-fd",
        str(write_fd),
        *extra,
    ]
    process = subprocess.Popen(command, env={**os.environ, **(env or {})}, pass_fds=(write_fd,),
                               start_new_session=new_session)  # fmt: skip
    os.close(write_fd)
    try:
        ports = _read_ready(process, read_fd, time.monotonic() + STARTUP_DEADLINE_S)
    except BaseException:
        process.kill()
        process.wait()
        raise
    finally:
        os.close(read_fd)
    server = RunningServer(  # -1: an endpoint switched off (--allow-http false, ...)
        process, ports.get("http_port", -1), ports.get("grpc_port", -1),
        ports.get("metrics_port", -1), repository,
    )  # fmt: skip
    try:
        yield server
    finally:
        stop_server(server)


def stop_server(server: RunningServer, timeout: float = 30.0) -> int:
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
        try:
            server.process.wait(timeout)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait()
    return server.process.returncode


@pytest.fixture(scope="session")
def example_server() -> Iterator[RunningServer]:
    """The bundled example repository, served once for the whole session."""
    with run_server(EXAMPLES) as server:
        yield server


@pytest.fixture(scope="session")
def test_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """tests/models (models made to fail, raise, and check behaviour), explicit control mode;
    the models that fail to load are UNAVAILABLE, the others serve (--exit-on-error false)."""
    repository = tmp_path_factory.mktemp("repo")
    for model in TEST_MODELS.iterdir():
        shutil.copytree(model, repository / model.name)
    flags = ("--model-control-mode", "explicit", "--load-model", "*", "--exit-on-error", "false")
    with run_server(repository, *flags) as server:
        yield server


def pending_requests(server: RunningServer, model: str) -> int:
    """Triton's pending-request gauge of ``model`` (version 1), from the metrics endpoint."""
    import re
    import urllib.request

    with urllib.request.urlopen(server.metrics_url, timeout=60) as response:
        text = response.read().decode()
    pattern = rf'^nv_inference_pending_request_count{{model="{model}",version="1"}} (\S+)$'
    found = re.search(pattern, text, re.MULTILINE)
    assert found is not None, text
    return int(float(found[1]))


def wait_pending(server: RunningServer, model: str, count: int, deadline_s: float = 60) -> None:
    """Ask the gauge until it reads ``count`` (there is no event; each ask is a round trip)."""
    deadline = time.monotonic() + deadline_s
    while (now := pending_requests(server, model)) != count:
        assert time.monotonic() < deadline, f"{model}: {now} pending, expected {count}"


class FifoGate:
    """The handshake of a model that holds a request inside ``execute``: the request's
    ``started`` and ``go`` parameters name two FIFOs; execute writes "started" to the first,
    then waits for a line on the second."""

    def __init__(self, folder: Path) -> None:
        import uuid

        self.started = folder / f"started-{uuid.uuid4().hex}"
        self.go = folder / f"go-{uuid.uuid4().hex}"
        for fifo in (self.started, self.go):
            os.mkfifo(fifo)
        self.parameters = {"started": str(self.started), "go": str(self.go)}

    def wait_started(self, deadline_s: float = 60) -> None:
        fd = os.open(self.started, os.O_RDONLY | os.O_NONBLOCK)
        try:  # execute has begun once it writes its line
            readable, _, _ = select.select([fd], [], [], deadline_s)
            assert readable, "the gated request did not reach execute"
            assert os.read(fd, 64) == b"started\n"
        finally:
            os.close(fd)

    def open(self) -> None:
        with open(self.go, "w") as go:
            go.write("go\n")


@pytest.fixture
def worker_runtime() -> Iterator[object]:
    """pb_utils with the runtime a worker installs when it starts (``worker/main.py``);
    the one before comes back after the test."""
    from dlserve.pb_utils import runtime
    from dlserve.worker.pb_utils_runtime import WORKER_RUNTIME

    previous = runtime.install(WORKER_RUNTIME)
    try:
        yield WORKER_RUNTIME
    finally:
        runtime.install(previous)


@pytest.fixture
def no_worker() -> Iterator[object]:
    """pb_utils with no worker's runtime, as a program that is no worker imports it."""
    from dlserve.pb_utils import runtime

    previous = runtime.install(runtime.NO_WORKER)
    try:
        yield runtime.NO_WORKER
    finally:
        runtime.install(previous)
