"""The host's side: /dev/shm, process limits, the cgroup's memory against the models' needs."""

from __future__ import annotations

import os
import re
import resource
import uuid
from pathlib import Path
from typing import Final

from dlserve.doctor.report import Row

SHM_DIR: Final = "/dev/shm"
MIB: Final = 1 << 20
NOFILE_WANTED: Final = 65536
MEMLOCK_WANTED: Final = 64 * MIB
# A worker process's resident memory with a numpy-only model loaded (38 MiB; one that imports
# torch: 221 MiB), and the server process's (66 MiB): examples/models served on this
# project's test machine, read with psutil (docs/deploy.md).
WORKER_BYTES: Final = 40 * MIB
SERVER_BYTES: Final = 70 * MIB
SHM_FIX: Final = (
    "docker: --shm-size=1g or --ipc=host; Kubernetes: an emptyDir with "
    "medium: Memory on /dev/shm (deploy/kubernetes/base)"
)


def mib(n: int) -> str:
    return f"{n / MIB:,.0f} MiB"


def shm_size(needed: int, folder: str = SHM_DIR) -> Row:
    """Enough room in /dev/shm for the clients' regions (a write past it is SIGBUS)."""
    try:
        stats = os.statvfs(folder)
    except OSError as exc:
        return Row("/dev/shm size", "fail", f"{folder}: {exc.strerror}", SHM_FIX)
    total, free = stats.f_blocks * stats.f_frsize, stats.f_bavail * stats.f_frsize
    found = f"{mib(free)} free of {mib(total)}"
    if free < needed:
        return Row(
            "/dev/shm size",
            "fail",
            f"{found}; clients need {mib(needed)} (--shm-need)",
            f"make it larger: {SHM_FIX}",
        )
    return Row("/dev/shm size", "ok", found)


def shm_writable(folder: str = SHM_DIR) -> Row:
    """A POSIX shared-memory object can be made, given pages and removed."""
    path = os.path.join(folder, f"dlserve_doctor_{os.getpid()}_{uuid.uuid4().hex[:8]}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        return Row(
            "/dev/shm writable",
            "fail",
            f"cannot create an object: {exc.strerror}",
            f"mount /dev/shm read-write, writable by this user: {SHM_FIX}",
        )
    try:
        os.posix_fallocate(fd, 0, MIB)  # pages for real: a full tmpfs says ENOSPC here
    except OSError as exc:
        return Row(
            "/dev/shm writable",
            "fail",
            f"cannot give an object pages: {exc.strerror}",
            f"free or enlarge /dev/shm: {SHM_FIX}",
        )
    finally:
        os.close(fd)
        os.unlink(path)
    return Row("/dev/shm writable", "ok", "an object was made, written and removed")


def fd_limit() -> Row:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    found = f"soft {_limit(soft)}, hard {_limit(hard)}"
    if soft != resource.RLIM_INFINITY and soft < 4096:
        return Row(
            "open files (nofile)",
            "warn",
            found,
            f"each worker, connection and region holds descriptors: ulimit -n "
            f"{NOFILE_WANTED} (docker: --ulimit nofile={NOFILE_WANTED})",
        )
    return Row("open files (nofile)", "ok", found)


def memlock_limit(gpus: int) -> Row:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    found = f"soft {_limit(soft)}"
    if gpus and soft != resource.RLIM_INFINITY and soft < MEMLOCK_WANTED:
        return Row(
            "locked memory (memlock)",
            "warn",
            found,
            "pinned host memory (models' torch pin_memory, CUDA host registration) "
            "counts here: ulimit -l unlimited (docker: --ulimit memlock=-1)",
        )
    return Row("locked memory (memlock)", "ok", found)


def _limit(value: int) -> str:
    return "unlimited" if value == resource.RLIM_INFINITY else f"{value:,}"


def cgroup_memory_limit() -> int | None:
    """The lowest memory limit of this process's cgroup and its ancestors, in bytes (cgroup
    v2's ``memory.max``, v1's ``memory.limit_in_bytes``); None: no limit."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            unified = Path("/sys/fs/cgroup")
            root = unified if (unified / "cgroup.controllers").exists() else unified / "unified"
            limits += _limits(root, path, "memory.max")
        elif "memory" in controllers.split(","):
            limits += _limits(Path("/sys/fs/cgroup/memory"), path, "memory.limit_in_bytes")
    return min(limits) if limits else None


def _limits(root: Path, path: str, name: str) -> list[int]:
    """The limits set on ``root/path`` and each folder above it, up to ``root``."""
    found = []
    folder = root / path.strip("/")
    while True:
        try:
            text = (folder / name).read_text().strip()
        except OSError:
            text = "max"
        if text != "max" and int(text) < 1 << 60:
            found.append(int(text))
        if folder == root or root not in folder.parents:
            return found
        folder = folder.parent


def instances(repository: Path, gpus: int) -> int:
    """The model instances a repository asks for: each model's instance groups' counts
    (a KIND_GPU group without ``gpus`` has its count on every GPU), 1 where it has none."""
    total = 0
    for config in sorted(repository.glob("*/config.pbtxt")):
        text = re.sub(r"#.*", "", config.read_text())
        start = text.find("instance_group")
        groups = _bracketed(text, text.find("[", start)) if start >= 0 else ""
        blocks = re.findall(r"\{(.*?)\}", groups, re.S)
        total += sum(_group_instances(block, gpus) for block in blocks) or 1
    return total


def _bracketed(text: str, start: int) -> str:
    """What is between ``text[start]`` (a ``[``) and its matching ``]``."""
    depth = 0
    for i in range(max(start, 0), len(text)):
        depth += {"[": 1, "]": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + 1 : i]
    return ""


def _group_instances(block: str, gpus: int) -> int:
    count = re.search(r"count\s*:\s*(\d+)", block)
    n = int(count[1]) if count else 1
    if "KIND_GPU" in block or ("KIND_" not in block and gpus):
        listed = re.search(r"gpus\s*:\s*\[([^\]]*)\]", block)
        return n * (len(listed[1].split(",")) if listed else max(gpus, 1))
    return n


def memory_for_models(repository: Path | None, gpus: int) -> Row:
    limit = cgroup_memory_limit()
    found = f"cgroup limit {mib(limit)}" if limit is not None else "no cgroup memory limit"
    if repository is None:
        return Row(
            "memory for the models",
            "ok" if limit is None else "skip",
            found + ("" if limit is None else "; --model-repository to compare"),
        )
    count = instances(repository, gpus)
    floor = SERVER_BYTES + count * WORKER_BYTES
    found += f"; {count} instances need at least {mib(floor)} before their models' own memory"
    if limit is not None and limit < floor:
        return Row(
            "memory for the models",
            "fail",
            found,
            f"raise the container's memory limit above {mib(floor)} plus the models' "
            "weights and the tensors in flight (docs/deploy.md)",
        )
    return Row("memory for the models", "ok", found)
