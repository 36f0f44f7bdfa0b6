"""A worker's CUDA region mappings: each handle is opened once and closed on unmap.

The exporter is this test process (tritonclient's cuda_shared_memory); the mapper is a real
second process, as a worker is (a CUDA IPC handle cannot be opened by its own exporter).
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from dlserve.tensors import cuda_ipc

cudashm = pytest.importorskip("tritonclient.utils.cuda_shared_memory", exc_type=RuntimeError)
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_ipc.available(), reason="no CUDA device"),
]

MAPPER = textwrap.dedent(
    """
    import base64, json, sys, time
    import numpy as np
    from dlserve.ipc import messages as m
    from dlserve.tensors import cuda_ipc
    from dlserve.worker.client_regions import ClientRegions

    handle = base64.b64decode(sys.argv[1])
    regions = ClientRegions()
    ref = m.TensorRef("x", "FP32", [16], m.Where.CUDA_REGION, 64, 64, 7, handle=handle)
    times = []
    for _ in range(200):
        start = time.perf_counter()
        pointer = regions.cuda_pointer(ref, "input 'x'")
        times.append(time.perf_counter() - start)
    host = np.empty(16, np.float32)
    cuda_ipc.copy(host.ctypes.data, pointer, 64)
    opens, mapped = regions.cuda_opens, len(regions)
    regions.unmap([7])
    print(json.dumps({"opens": opens, "mapped": mapped, "after_unmap": len(regions),
                      "first_us": times[0] * 1e6, "later_us": max(times[1:]) * 1e6,
                      "data": host.tolist()}))
    """
)


def test_a_handle_is_opened_once_and_closed_on_unmap() -> None:
    region = cudashm.create_shared_memory_region("once", 4096, 0)
    try:
        data = np.arange(16, dtype=np.float32) + 0.5
        cudashm.set_shared_memory_region(region, [np.zeros(16, np.float32), data])
        raw = base64.b64encode(base64.b64decode(cudashm.get_raw_handle(region))).decode()
        done = subprocess.run([sys.executable, "-c", MAPPER, raw], capture_output=True,
                              text=True, timeout=120, check=True)  # fmt: skip
        report = json.loads(done.stdout)
    finally:
        cudashm.destroy_shared_memory_region(region)
    assert report["opens"] == 1 and report["mapped"] == 1 and report["after_unmap"] == 0
    assert report["data"] == data.tolist()  # the view is at the ref's offset
    assert report["later_us"] < 50, report  # a dictionary lookup, not another open
