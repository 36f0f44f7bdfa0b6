"""tensors/heap.py: large buffers keep their pages (glibc's malloc tuned), unless the user
tuned it already. Each case runs in a fresh interpreter: the setting is process-wide."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

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
