"""The server runs without transparent huge pages (``tensors/heap.py``): the event loop
writes the fresh pages of arriving messages, and a huge page's fault holds it while 2 MiB
are zeroed. Its workers run the models with the setting the server was started with."""

from __future__ import annotations

import sys
from pathlib import Path

import psutil
import pytest

from conftest import EXAMPLES, run_server


def _huge_pages(pid: int | str = "self") -> str:
    """The kernel's THP_enabled for a process: "1", "0" (PR_SET_THP_DISABLE), "" unknown."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("THP_enabled:"):
            return line.split()[1]
    return ""


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or _huge_pages() != "1",
    reason="needs Linux's THP_enabled, and huge pages on for this process",
)
def test_the_server_runs_without_huge_pages_and_its_models_with_them() -> None:
    with run_server(EXAMPLES, "--model-control-mode", "explicit", "--load-model", "add_sub",
                    "--load-model", "identity_fp32") as server:  # fmt: skip
        workers = [p for p in psutil.Process(server.process.pid).children()
                   if "dlserve.worker.main" in p.cmdline()]  # fmt: skip
        assert len(workers) >= 2
        assert _huge_pages(server.process.pid) == "0"
        assert [_huge_pages(worker.pid) for worker in workers] == ["1"] * len(workers)
