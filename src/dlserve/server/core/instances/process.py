"""A worker in a process of its own: ``python -m dlserve.worker.main`` (or the model's own
Python environment's interpreter), its frames over a socketpair, its arenas as memfds
passed at spawn. A worker handle owns one :class:`ProcessLauncher` for such a worker."""

from __future__ import annotations

import asyncio
import signal
import socket
import sys

from dlserve.server.core.instances import polling
from dlserve.server.core.instances.environments import ExecEnv
from dlserve.tensors import heap
from dlserve.tensors.arena import ShmSegment


class ProcessLauncher:
    """Starts, waits for and stops one worker process."""

    def __init__(self, exec_env: ExecEnv | None = None) -> None:
        self.exec_env = exec_env  # the model's own Python environment (EXECUTION_ENV_PATH)
        self.process: asyncio.subprocess.Process | None = None

    async def start(
        self, label: str, channel: socket.socket, descriptors: socket.socket,
        arenas: tuple[ShmSegment, ShmSegment], env: dict[str, str] | None,
    ) -> None:  # fmt: skip
        """Spawn the worker with the other ends of its channel and its descriptor socket
        (both closed here: the process has its own copies)."""
        in_fd, out_fd = arenas[0].fd, arenas[1].fd
        assert in_fd is not None and out_fd is not None
        options = ["--fd", str(channel.fileno()), "--input-arena-fd", str(in_fd),
                   "--output-arena-fd", str(out_fd), "--fd-socket", str(descriptors.fileno()),
                   "--poll-us", str(polling.worker_poll_us())]  # fmt: skip
        if heap.huge_pages_turned_off():  # the server's own setting: not the model's
            options.append("--huge-pages")
        if self.exec_env is None:
            command = [sys.executable, "-m", "dlserve.worker.main", *options]
        else:
            command = self.exec_env.command(options)
            env = self.exec_env.environment() if env is None else env
        env = heap.streaming_copies(env)  # megabytes leave the worker without its caches
        try:
            self.process = await asyncio.create_subprocess_exec(
                *command, pass_fds=(channel.fileno(), in_fd, out_fd, descriptors.fileno()),
                env=env, stdin=asyncio.subprocess.DEVNULL,
            )  # fmt: skip
        finally:  # the arenas' memfds stay open: other workers map them through /proc (BLS)
            channel.close()
            descriptors.close()

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def ending(self) -> str:
        """How the process ended ("" while it runs, or before it started)."""
        code = None if self.process is None else self.process.returncode
        return "" if code is None else _ending(code)

    async def reaped(self, timeout: float) -> None:
        """Wait (briefly) for the process's exit status."""
        if self.process is not None:
            try:
                await asyncio.wait_for(self.process.wait(), timeout)
            except TimeoutError:
                pass

    async def terminate(self, timeout: float) -> None:
        """Wait for the process to exit; kill it past ``timeout``."""
        process = self.process
        if process is None or process.returncode is not None:
            return
        try:
            await asyncio.wait_for(process.wait(), timeout)
        except TimeoutError:
            process.kill()
            await process.wait()


def _ending(returncode: int) -> str:
    """How a process ended, from its return code (negative: the signal that killed it)."""
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        name = f" ({signal.Signals(-returncode).name})"
    except ValueError:
        name = ""
    return f"was killed by signal {-returncode}{name}"
