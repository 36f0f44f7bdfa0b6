"""Triton's C++ load generator, ``perf_analyzer`` 2.51, unpacked under ``.bench/``.

It ships as ``bin/perf_analyzer`` in the tritonclient 2.51.0 wheel (the data folder of the
wheel, not the Python package) and needs two libraries the wheel does not bring: Debian's
``libb64-0d`` (``libb64.so.0d``) and ``libcudart.so.12``, taken from the
``nvidia-cuda-runtime-cu12`` wheel (it loads on a machine without a GPU; only CUDA shared
memory needs a device). ``ensure_perf_analyzer()`` puts all three in
``.bench/perf_analyzer/`` once:

1. ``pip download tritonclient==2.51.0 nvidia-cuda-runtime-cu12 --no-deps`` into
   ``.bench/wheels``, and ``apt-get download libb64-0d`` there;
2. the binary, ``libcudart.so.12`` and ``libb64.so.0d`` out of them (``dpkg -x`` for the
   ``.deb``).

On a machine with no package registry (the GPU host) copy the prepared
``.bench/perf_analyzer/`` folder there: nothing is downloaded when it is complete.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _triton  # a sibling module, not a package

VERSION = "2.51.0"
HOME = _triton.BENCH_DIR / "perf_analyzer"
BINARY = HOME / "perf_analyzer"
LIBS = HOME / "lib"
_PLATFORMS = ("manylinux1_x86_64", "manylinux2014_x86_64", "manylinux_2_17_x86_64")


def _download(requirement: str, pattern: str) -> Path:
    found = sorted(_triton.WHEEL_DIR.glob(pattern))
    if not found:
        platforms = [arg for p in _PLATFORMS for arg in ("--platform", p)]
        _triton.pip("download", requirement, "--no-deps", "--only-binary=:all:", *platforms,
                    "--dest", str(_triton.WHEEL_DIR))  # fmt: skip
        found = sorted(_triton.WHEEL_DIR.glob(pattern))
    if not found:
        raise FileNotFoundError(f"no {pattern} in {_triton.WHEEL_DIR} after pip download")
    return found[-1]


def _extract(wheel: Path, member_suffix: str, target: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(member_suffix)]
        with archive.open(name) as source, open(target, "wb") as out:
            shutil.copyfileobj(source, out)


def _libb64(target: Path) -> None:
    debs = sorted(_triton.WHEEL_DIR.glob("libb64-0d_*.deb"))
    if not debs:
        subprocess.run(["apt-get", "download", "libb64-0d"], cwd=_triton.WHEEL_DIR, check=True)
        debs = sorted(_triton.WHEEL_DIR.glob("libb64-0d_*.deb"))
    with tempfile.TemporaryDirectory() as root:
        subprocess.run(["dpkg", "-x", str(debs[-1]), root], check=True)
        (found,) = Path(root).rglob("libb64.so.0d")
        shutil.copy2(found.resolve(), target)


def ensure_perf_analyzer() -> Path:
    """The perf_analyzer binary, installed under .bench/ unless it is there already."""
    if BINARY.exists() and (LIBS / "libb64.so.0d").exists() and (LIBS / "libcudart.so.12").exists():
        return BINARY
    LIBS.mkdir(parents=True, exist_ok=True)
    _triton.WHEEL_DIR.mkdir(parents=True, exist_ok=True)
    client = _download(f"tritonclient=={VERSION}", f"tritonclient-{VERSION}-*.whl")
    runtime = _download("nvidia-cuda-runtime-cu12", "nvidia_cuda_runtime_cu12-*.whl")
    _extract(runtime, "/libcudart.so.12", LIBS / "libcudart.so.12")
    _libb64(LIBS / "libb64.so.0d")
    _extract(client, "/data/bin/perf_analyzer", BINARY)
    _triton.make_executable(BINARY)
    return BINARY


def environment() -> dict[str, str]:
    """This environment with perf_analyzer's libraries on LD_LIBRARY_PATH."""
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        p for p in (str(LIBS), env.get("LD_LIBRARY_PATH", "")) if p
    )
    return env
