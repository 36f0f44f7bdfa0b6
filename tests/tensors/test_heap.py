"""tensors/heap.py: large buffers keep their pages (glibc's malloc tuned), unless the user
tuned it already. Each case runs in a fresh interpreter: the setting is process-wide."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from dlserve.tensors import heap

CODE = "from dlserve.tensors import heap; print(heap.keep_large_buffers())"
GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


def _run(**env: str) -> str:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    result = subprocess.run(
        [sys.executable, "-c", CODE], env={**environ, **env}, capture_output=True, text=True,
        check=True, timeout=60,
    )  # fmt: skip
    return result.stdout.strip()


@pytest.mark.skipif(not GLIBC, reason="needs glibc")
def test_glibc_is_tuned() -> None:
    assert _run() == "True"


@pytest.mark.parametrize("variable", ["MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"])
def test_the_users_own_setting_wins(variable: str) -> None:
    assert _run(**{variable: "1048576"}) == "False"


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
