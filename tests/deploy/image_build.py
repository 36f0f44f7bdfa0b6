"""Build deploy/docker/Dockerfile without a Docker daemon or a registry, and run its image.

- The base image: ``debootstrap`` makes a minimal Debian (python3 and its venv module), which
  ``buildah`` imports as ``localhost/dlserve-test-base:<suite>`` (kept between runs).
- The build context holds only ``dist/``: dlserve's wheel and the wheels of its dependencies,
  so the image installs offline (``PIP_OPTIONS=--no-index --find-links /dist``).
- ``buildah bud --isolation chroot`` builds the same Dockerfile users build with docker, the
  base image given as a build argument; ``buildah run --isolation chroot`` runs a container
  that shares the host's network and /dev/shm (what ``docker run --network=host
  --ipc=host`` gives).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"
GPU_DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile.gpu"
SUITE = os.environ.get("DLSERVE_IMAGE_SUITE", "bookworm")
MIRROR = os.environ.get("DLSERVE_DEBIAN_MIRROR", "http://deb.debian.org/debian")
BASE = f"localhost/dlserve-test-base:{SUITE}"
KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"  # debootstrap checks the mirror
CHROOT = ("--isolation", "chroot")
# What a base image does not need: package caches, documentation, translations.
STRIP = ("var/cache/apt/archives", "var/lib/apt/lists", "usr/share/doc", "usr/share/locale",
         "usr/share/man")  # fmt: skip


def missing_tools() -> str | None:
    """Why the image cannot be built here, or None."""
    absent = [tool for tool in ("buildah", "debootstrap") if shutil.which(tool) is None]
    if absent:
        return f"{' and '.join(absent)} not installed (scripts/setup installs them as root)"
    if os.geteuid() != 0:
        return "debootstrap and buildah's chroot isolation need root"
    if not Path(KEYRING).exists():
        return f"{KEYRING} missing (debian-archive-keyring; scripts/setup installs it as root)"
    return None


def buildah(*args: str) -> str:
    done = subprocess.run(["buildah", *args], check=True, capture_output=True, text=True)
    return done.stdout.strip()


def has_image(name: str) -> bool:
    found = subprocess.run(["buildah", "images", "-q", name], capture_output=True, text=True)
    return found.returncode == 0 and bool(found.stdout.strip())


def base_image() -> str:
    """A minimal Debian with python3 and venv, made once per machine."""
    if has_image(BASE):
        return BASE
    with tempfile.TemporaryDirectory(prefix="dlserve-base-") as work:
        rootfs = Path(work) / "rootfs"
        subprocess.run(
            ["debootstrap", "--variant=minbase", "--include=python3,python3-venv", SUITE,
             str(rootfs), MIRROR],
            check=True, capture_output=True,
        )  # fmt: skip
        for folder in STRIP:
            shutil.rmtree(rootfs / folder, ignore_errors=True)
        with tarfile.open(Path(work) / "rootfs.tar", "w") as tar:
            tar.add(rootfs, arcname=".")
        (Path(work) / "Containerfile").write_text("FROM scratch\nADD rootfs.tar /\n")
        buildah("bud", *CHROOT, "-q", "-t", BASE, "-f", f"{work}/Containerfile", work)
    return BASE


def build_context(folder: Path) -> Path:
    """``folder/dist``: dlserve's wheel, built from this checkout, and its dependencies'
    (the ``gpu`` extra's too, for Dockerfile.gpu)."""
    dist = folder / "dist"
    pip = [sys.executable, "-m", "pip", "wheel", "-q", "--wheel-dir", str(dist)]
    subprocess.run([*pip, "--no-deps", str(ROOT)], check=True, capture_output=True)
    (wheel,) = dist.glob("dlserve-*.whl")
    subprocess.run([*pip, f"{wheel}[gpu]"], check=True, capture_output=True)
    return folder


def build_image(tag: str, context: Path, base: str, dockerfile: Path = DOCKERFILE) -> None:
    """The Dockerfile as it is, in Docker's format (which keeps HEALTHCHECK)."""
    buildah(
        "bud", *CHROOT, "--format", "docker", "--layers=false", "-q", "-t", tag,
        "--build-arg", f"BASE_IMAGE={base}",
        "--build-arg", "PIP_OPTIONS=--no-index --find-links /dist",
        "-f", str(dockerfile), str(context),
    )  # fmt: skip


def image_config(tag: str) -> dict[str, object]:
    config: dict[str, object] = json.loads(buildah("inspect", "--type", "image", tag))["Docker"][
        "config"
    ]
    return config


def image_size(tag: str) -> int:
    """Bytes of the image's layers, uncompressed (what ``docker images`` shows)."""
    found = buildah("images", "--format", "{{.Size}}", tag)
    number, unit = found.split()
    return int(float(number) * {"kB": 1e3, "MB": 1e6, "GB": 1e9}[unit])


def container(tag: str) -> str:
    return buildah("from", "-q", tag)


def remove_container(name: str) -> None:
    subprocess.run(["buildah", "rm", name], capture_output=True)


def remove_image(tag: str) -> None:
    subprocess.run(["buildah", "rmi", "-f", tag], capture_output=True)


def run_command(name: str, *command: str, volumes: tuple[str, ...] = (),
                env: dict[str, str] | None = None) -> list[str]:  # fmt: skip
    """``buildah run`` of ``command`` in container ``name`` (host network, host /dev/shm)."""
    options = [f"--volume={v}" for v in volumes]
    options += [f"--env={k}={v}" for k, v in (env or {}).items()]
    return ["buildah", "run", *CHROOT, *options, name, "--", *command]
