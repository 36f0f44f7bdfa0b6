"""NVIDIA MPS for the workers (``dlserve serve --mps``).

Every worker process has its own CUDA context, and a GPU runs one context at a time: when
work from another process's context arrives, the GPU switches, and the first copy after
another process's kernel costs many times a copy without a switch (``tools/cuda_calls.py``;
the numbers are on the performance page). A BLS pipeline switches contexts at every hop.
The Multi-Process Service runs the work of all its clients in one context, so nothing
switches. ``--mps`` starts a private MPS control daemon (its pipe and log folders in a
temporary folder of this server's own) before any worker starts; the workers, and the
server itself, connect to it through ``CUDA_MPS_PIPE_DIRECTORY``. It is stopped at
shutdown, and dies with the server (it runs in the foreground as the server's child, and
the kernel sends it SIGTERM when the server's main thread goes).

Without ``--mps``, workers use whatever MPS the environment already has (a system-wide
daemon, or ``CUDA_MPS_PIPE_DIRECTORY`` set by the user), like any CUDA program.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dlserve.errors import FatalError

log = logging.getLogger("dlserve.mps")

CONTROL = "nvidia-cuda-mps-control"
READY_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 10.0


# Run in place of the daemon: ask for SIGTERM when the server dies, then become the daemon
# (the request survives exec). A shim rather than preexec_fn: the server has threads.
_SHIM = (
    "import ctypes, os, signal, sys; "
    "ctypes.CDLL(None).prctl(1, signal.SIGTERM); "  # PR_SET_PDEATHSIG
    "os.execv(sys.argv[1], sys.argv[1:])"
)


class MpsDaemon:
    """A private MPS control daemon; ``env`` is what its clients need."""

    def __init__(self, control: str, folder: Path, process: subprocess.Popen[bytes]) -> None:
        self.control = control
        self.folder = folder
        self.process = process
        self.env = {
            "CUDA_MPS_PIPE_DIRECTORY": str(folder / "pipe"),
            "CUDA_MPS_LOG_DIRECTORY": str(folder / "log"),
        }

    @classmethod
    def start(cls) -> MpsDaemon:
        """Start the daemon and wait until it listens; FatalError when it cannot."""
        control = shutil.which(CONTROL)
        if control is None:
            raise FatalError(
                f"--mps: {CONTROL} is not on PATH (it ships with the NVIDIA driver); "
                "start without --mps, or put the driver's bin folder on PATH"
            )
        folder = Path(tempfile.mkdtemp(prefix="dlserve-mps-"))
        (folder / "pipe").mkdir()
        (folder / "log").mkdir()
        env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(folder / "pipe"),
               "CUDA_MPS_LOG_DIRECTORY": str(folder / "log")}  # fmt: skip
        with open(folder / "log" / "daemon.out", "wb") as out:
            # a session of its own: Ctrl-C or a SIGTERM to the server's process group must
            # not stop it while the server still finishes the requests in flight
            process = subprocess.Popen(
                [sys.executable, "-c", _SHIM, control, "-f"], env=env,
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        daemon = cls(control, folder, process)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not (folder / "pipe" / "control").exists():
            if process.poll() is not None or time.monotonic() > deadline:
                output = (folder / "log" / "daemon.out").read_text(errors="replace").strip()
                daemon.stop()
                raise FatalError(f"--mps: {CONTROL} did not start: {output or 'no output'}")
            time.sleep(0.01)
        log.info("MPS control daemon started (pipe %s)", folder / "pipe")
        return daemon

    def command(self, text: str) -> str:
        """Send one command to the daemon (``get_server_list``, ...); its answer."""
        result = subprocess.run(
            [self.control], input=text.encode() + b"\n", capture_output=True,
            env={**os.environ, **self.env}, timeout=STOP_TIMEOUT_S, check=False,
        )  # fmt: skip
        return result.stdout.decode(errors="replace").strip()

    def stop(self) -> None:
        """Ask the daemon to quit (its MPS server goes with it), then remove its folder."""
        if self.process.poll() is None:
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                self.command("quit")
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)
