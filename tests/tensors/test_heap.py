"""tensors/heap.py: large buffers keep their pages (glibc's malloc tuned), unless the user
tuned it already; the server runs without transparent huge pages, its models with the
setting it started with (a real server: tests/e2e/test_huge_pages.py). Each case runs in
a fresh interpreter: the settings are process-wide."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from dlserve.tensors import heap

CODE = "from dlserve.tensors import heap; print(heap.keep_large_buffers())"
GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


def _run(code: str = CODE, **env: str) -> str:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    result = subprocess.run(
        [sys.executable, "-c", code], env={**environ, **env}, capture_output=True, text=True,
        check=True, timeout=60,
    )  # fmt: skip
    return result.stdout.strip()


@pytest.mark.skipif(not GLIBC, reason="needs glibc")
def test_glibc_is_tuned() -> None:
    assert _run() == "True"


@pytest.mark.parametrize("variable", ["MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"])
def test_the_users_own_setting_wins(variable: str) -> None:
    assert _run(**{variable: "1048576"}) == "False"


# Threads allocate from one heap: a buffer a thread allocates and frees is found free by
# give_back in the heap it shares with the others, so the trim gives it back.
ONE_HEAP = """
import threading
from dlserve.tensors import heap
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 >> 20
one = heap.one_heap()
heap.keep_large_buffers()
def thread():
    blocks = [b"x" * 2**20 for _ in range(64)]  # 64 MiB in 1-MiB buffers, written, freed
worker = threading.Thread(target=thread)
worker.start()
worker.join()
kept = rss()
heap.give_back()
print(one, kept, rss())
"""


@pytest.mark.skipif(not GLIBC, reason="needs glibc")
def test_a_threads_freed_buffers_are_given_back() -> None:
    one, kept, after = _run(ONE_HEAP).split()
    assert one == "True"
    assert int(kept) - int(after) >= 48, (kept, after)


@pytest.mark.skipif(not GLIBC, reason="needs glibc")
def test_the_users_own_arena_setting_wins() -> None:
    one, kept, after = _run(ONE_HEAP, MALLOC_ARENA_MAX="8").split()
    assert one == "False"
    assert int(kept) - int(after) < 16, (kept, after)  # the thread's heap kept its buffers


X86_LINUX = sys.platform.startswith("linux") and platform.machine() == "x86_64"


@pytest.mark.skipif(not X86_LINUX, reason="glibc's x86 tunable")
def test_workers_copy_megabytes_with_non_temporal_stores() -> None:
    env = heap.streaming_copies({"PATH": "/bin"})
    setting = "glibc.cpu.x86_non_temporal_threshold=0x100000"
    assert env == {"PATH": "/bin", "GLIBC_TUNABLES": setting}
    other = heap.streaming_copies({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert other["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:{setting}"


def test_the_users_non_temporal_threshold_wins() -> None:
    mine = {"GLIBC_TUNABLES": "glibc.cpu.x86_non_temporal_threshold=0x4000000"}
    assert heap.streaming_copies(mine) == mine


def _huge_pages(pid: int | str = "self") -> str:
    """The kernel's THP_enabled for a process: "1", "0" (PR_SET_THP_DISABLE), "" unknown."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("THP_enabled:"):
            return line.split()[1]
    return ""


HUGE_PAGES = sys.platform.startswith("linux") and _huge_pages() == "1"
needs_huge_pages = pytest.mark.skipif(not HUGE_PAGES, reason="THP_enabled not 1 here")


def _python(code: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", f"from pathlib import Path\n{code}"], capture_output=True,
        text=True, check=True, timeout=60,
    )  # fmt: skip
    return done.stdout.split()


STATUS = "Path('/proc/self/status').read_text().split('THP_enabled:')[1].split()[0]"


@needs_huge_pages
def test_huge_pages_off_here_and_back_on_in_a_process_started_from_here() -> None:
    child = (
        "from pathlib import Path; from dlserve.tensors import heap;"
        f" print(heap.huge_pages_again(), {STATUS})"
    )
    out = _python(
        "import subprocess, sys\nfrom dlserve.tensors import heap\n"
        f"print(heap.no_huge_pages(), heap.huge_pages_turned_off(), {STATUS})\n"
        f"print(subprocess.run([sys.executable, '-c', {child!r}], capture_output=True,"
        " text=True, check=True).stdout)"
    )  # fmt: skip
    # off here; a process started from here inherits "off" until it turns them back on
    assert out == ["True", "True", "0", "True", "1"]


@needs_huge_pages
def test_huge_pages_off_already_are_left_off() -> None:
    """Started with huge pages off (its parent's choice): nothing is turned off here, so
    nothing is turned back on in the processes started from here."""
    out = _python(
        "import ctypes\nfrom dlserve.tensors import heap\n"
        "ctypes.CDLL(None).prctl(heap.PR_SET_THP_DISABLE, 1, 0, 0, 0)\n"
        f"print(heap.no_huge_pages(), heap.huge_pages_turned_off(), {STATUS})"
    )  # fmt: skip
    assert out == ["False", "False", "0"]
