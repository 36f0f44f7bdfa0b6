"""Fences between workers (``worker/bls/cuda_peers.py``) on a real GPU: before a fence is
sent, the sender drops it when the work it marks is done, and keeps it while that work
is still queued. The end-to-end orderings are in ``tests/e2e/test_bls_gpu.py``."""

from __future__ import annotations

import pytest

from dlserve.ipc import messages as m
from dlserve.worker.bls import cuda_peers

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]


def test_a_fence_is_kept_while_its_work_is_queued_and_dropped_once_it_is_done() -> None:
    device = torch.cuda.current_device()
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time, queued on the legacy stream
    marks = cuda_peers.fences([device])
    assert len(marks) == 1, "interprocess events are available on this machine"
    assert cuda_peers.unfinished(marks) == marks
    torch.cuda.synchronize()
    assert cuda_peers.unfinished(marks) == []


def test_a_fence_this_process_did_not_make_is_kept() -> None:
    device = torch.cuda.current_device()
    (mark,) = cuda_peers.fences([device])
    torch.cuda.synchronize()
    other = m.Fence(mark.device, bytes(len(mark.handle)))  # not our event's handle
    assert cuda_peers.unfinished([other]) == [other]
