"""A worker in a thread of the server (tests, ``--debug``): the very loop a worker process
runs (``dlserve.worker.main.serve``), over the same socketpair and frames, with its own
mappings of the arenas. The one module of the server that imports the worker runtime
(``scripts/check_layers.py``, EXCEPTIONS)."""

from __future__ import annotations

import asyncio
import os
import socket
import threading

from dlserve.ipc import codec
from dlserve.ipc import messages as m
from dlserve.ipc.channel import BlockingChannel, ChannelClosed
from dlserve.tensors.arena import ShmSegment


class ThreadLauncher:
    """Starts and joins one worker thread."""

    pid = None  # no process of its own

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None

    async def start(
        self, label: str, channel: socket.socket, descriptors: socket.socket,
        arenas: tuple[ShmSegment, ShmSegment], env: dict[str, str] | None,
    ) -> None:  # fmt: skip
        """Run the worker loop on the other ends of its channel and descriptor socket
        (closed when the loop ends); ``env`` does not apply (the server's own)."""
        from dlserve.worker.main import install_pb_utils, serve

        install_pb_utils()
        blocking: BlockingChannel[m.ServerToWorker] = BlockingChannel(channel, codec.to_worker)
        shared = (_share(arenas[0]), _share(arenas[1]))

        def run() -> None:
            try:
                serve(blocking, shared, descriptors)
            except ChannelClosed:
                pass
            finally:
                blocking.close()
                descriptors.close()

        self._thread = threading.Thread(target=run, name=f"worker-{label}", daemon=True)
        self._thread.start()

    def ending(self) -> str:
        return ""  # a thread has no exit status

    async def reaped(self, timeout: float) -> None:
        """Nothing to reap: the thread's loop ends with its connection."""

    async def terminate(self, timeout: float) -> None:
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout)


def _share(segment: ShmSegment) -> ShmSegment:
    """The worker thread's own mapping of a segment, as a worker process would have."""
    assert segment.fd is not None
    return ShmSegment.from_fd(os.dup(segment.fd), segment.name)
