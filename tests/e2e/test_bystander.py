"""The liveness probe of the network edge's tests (bystander.py) measures what it says:
quiet, it passes its own bound; a server that holds every request back fails it."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator

import pytest
from bystander import Bystander

from conftest import EXAMPLES, RunningServer, run_server


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with run_server(EXAMPLES) as running:
        yield running


def test_a_quiet_server_passes(server: RunningServer) -> None:
    with Bystander(server.http_url, server.grpc_url) as bystander:
        alone = bystander.alone()
        with bystander.watching() as seen:
            threading.Event().wait(1.0)
        seen.check(alone)


def test_a_stopped_server_fails(server: RunningServer) -> None:
    with Bystander(server.http_url, server.grpc_url) as bystander:
        alone = bystander.alone()
        with bystander.watching() as seen:
            os.kill(server.process.pid, signal.SIGSTOP)  # the request in flight waits 200 ms
            try:
                threading.Event().wait(0.2)
            finally:
                os.kill(server.process.pid, signal.SIGCONT)
        # the call in flight is a health check (it takes 200 ms) or an inference (one of the
        # few the watch makes, so the p99 is that one): either bound fails
        with pytest.raises(AssertionError, match=r"health answered in|inference p99 "):
            seen.check(alone)
