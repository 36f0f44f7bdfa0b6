"""The two kinds of worker: a process of its own, or a thread of the server.

:class:`SubprocessWorker` runs the worker as ``python -m dlserve.worker.main`` over a
socketpair; :class:`InProcessWorker` runs the very same loop in a thread (tests,
``--debug``).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import threading

from dlserve import errors
from dlserve.ipc import codec
from dlserve.ipc import messages as m
from dlserve.ipc.channel import BlockingChannel, ChannelClosed
from dlserve.server.core.instances import polling
from dlserve.server.core.instances.environments import ExecEnv
from dlserve.server.core.instances.handle import WorkerBase
from dlserve.tensors import heap
from dlserve.tensors.arena import ShmSegment


class SubprocessWorker(WorkerBase):
    """A worker in its own process."""

    def __init__(self, label: str, exec_env: ExecEnv | None = None) -> None:
        super().__init__(label)
        self.process: asyncio.subprocess.Process | None = None
        self.exec_env = exec_env  # the model's own Python environment (EXECUTION_ENV_PATH)

    async def spawn(self, env: dict[str, str] | None = None) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        fds_theirs = self._descriptor_socket()
        in_fd, out_fd = self.input_segment.fd, self.output_segment.fd
        assert in_fd is not None and out_fd is not None
        options = ["--fd", str(theirs.fileno()), "--input-arena-fd", str(in_fd),
                   "--output-arena-fd", str(out_fd), "--fd-socket", str(fds_theirs.fileno()),
                   "--busy-poll-us", str(polling.busy_poll_us())]  # fmt: skip
        if self.exec_env is None:
            command = [sys.executable, "-m", "dlserve.worker.main", *options]
        else:
            command = self.exec_env.command(options)
            env = self.exec_env.environment() if env is None else env
        env = heap.streaming_copies(env)  # megabytes leave the worker without its caches
        try:
            self.process = await asyncio.create_subprocess_exec(
                *command, pass_fds=(theirs.fileno(), in_fd, out_fd, fds_theirs.fileno()),
                env=env, stdin=asyncio.subprocess.DEVNULL,
            )  # fmt: skip
        finally:  # the arenas' memfds stay open: other workers map them through /proc (BLS)
            theirs.close()
            fds_theirs.close()
        await self._connect(ours)

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def death_reason(self) -> str:
        code = None if self.process is None else self.process.returncode
        return errors.not_healthy(self.label, "" if code is None else _ending(code))

    async def _reaped(self, timeout: float) -> None:
        if self.process is not None:
            try:
                await asyncio.wait_for(self.process.wait(), timeout)
            except TimeoutError:
                pass

    async def _terminate(self, timeout: float) -> None:
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


class InProcessWorker(WorkerBase):
    """The worker loop in a thread of the server process (tests, ``--debug``)."""

    def __init__(self, label: str) -> None:
        super().__init__(label)
        self._thread: threading.Thread | None = None

    async def spawn(self, env: dict[str, str] | None = None) -> None:
        from dlserve.worker.main import install_pb_utils, serve

        install_pb_utils()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        fds_theirs = self._descriptor_socket()
        channel: BlockingChannel[m.ServerToWorker] = BlockingChannel(theirs, codec.to_worker)
        arenas = (self._share(self.input_segment), self._share(self.output_segment))

        def run() -> None:
            try:
                serve(channel, arenas, fds_theirs)
            except ChannelClosed:
                pass
            finally:
                channel.close()
                fds_theirs.close()

        self._thread = threading.Thread(target=run, name=f"worker-{self.label}", daemon=True)
        self._thread.start()
        await self._connect(ours)

    @staticmethod
    def _share(segment: ShmSegment) -> ShmSegment:
        """The worker thread's own mapping of a segment, as a worker process would have."""
        assert segment.fd is not None
        return ShmSegment.from_fd(os.dup(segment.fd), segment.name)

    async def _terminate(self, timeout: float) -> None:
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout)
