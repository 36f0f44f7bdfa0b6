"""A real server at its defaults gives back what large requests left in its heap once it
is idle (``server/core/host/idle_trim.py``): under load it keeps freed buffers so that the
next large request reuses resident pages (``tensors/heap.py``); a few seconds after the
load stops its private memory (``RssAnon``) is back within 10% of where it was before the
load. (The shared-memory arenas it shares with the model's worker, ``RssShmem``, keep the
size of the largest request: that is the channel's design, not the heap.)"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.http as httpclient

from conftest import EXAMPLES, RunningServer, run_server
from dlserve.server.core.host.idle_trim import IDLE_S

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc, /proc")
MIB = 2**20
ELEMENTS = 6 * MIB  # 24 MiB of FP32 each way: below the 32 MiB glibc maps on its own


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with run_server(EXAMPLES) as running:
        yield running


def _rss(server: RunningServer) -> int:
    """The server's resident private memory (``RssAnon``), in bytes."""
    with open(f"/proc/{server.process.pid}/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/PID/status")


def test_the_heap_large_requests_left_goes_back_once_idle(server: RunningServer) -> None:
    baseline = _rss(server)
    data = np.arange(ELEMENTS, dtype=np.float32).reshape(1, ELEMENTS)
    with httpclient.InferenceServerClient(server.http_url, network_timeout=60) as client:
        for _ in range(3):
            tensor = httpclient.InferInput("INPUT0", [1, ELEMENTS], "FP32")
            tensor.set_data_from_numpy(data, binary_data=True)
            result = client.infer("identity_fp32", [tensor])
            assert np.array_equal(result.as_numpy("OUTPUT0"), data)
    kept = _rss(server)
    assert kept - baseline >= 32 * MIB, (baseline / MIB, kept / MIB)  # the load's buffers
    deadline = time.monotonic() + 4 * IDLE_S
    while (rss := _rss(server)) > baseline * 1.1 and time.monotonic() < deadline:
        time.sleep(0.1)  # a state polled until a deadline, not a wait for an event
    assert rss <= baseline * 1.1, (baseline / MIB, kept / MIB, rss / MIB)
