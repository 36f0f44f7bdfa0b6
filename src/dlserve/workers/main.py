"""Entry point of a worker process: ``python -m dlserve.workers.main --fd N``.

The worker imports only dlserve's model-side packages and the user's code. It
serves one connection (inherited file descriptor) until the server says
Shutdown or goes away.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import socket
import sys

from dlserve import backend
from dlserve.ipc import codec
from dlserve.ipc import messages as m
from dlserve.ipc.channel import BlockingChannel, ChannelClosed
from dlserve.workers.runner import LoadError, ModelRunner

Channel = BlockingChannel[m.ServerToWorker]


def _die_with_parent() -> None:
    """Ask the kernel to SIGKILL this worker when the server process dies (Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def install_pb_utils() -> None:
    """Make ``import triton_python_backend_utils`` find dlserve's implementation."""
    sys.modules["triton_python_backend_utils"] = backend


def load(channel: Channel, msg: m.Load, runner: ModelRunner | None) -> ModelRunner | None:
    if runner is not None:
        runner.update(msg)
    else:
        try:
            runner = ModelRunner(msg)
        except OSError as exc:
            channel.send(m.LoadFailed(message=f"cannot set up shared memory: {exc}"))
            return None
    try:
        runner.start()
    except LoadError as exc:
        runner.finalize()
        channel.send(m.LoadFailed(message=str(exc)))
        return None
    channel.send(
        m.Loaded(
            config_json=json.dumps(runner.config),
            output_arena=runner.output_segment.name,
            pid=os.getpid(),
        )
    )
    return runner


def serve(channel: Channel) -> None:
    runner: ModelRunner | None = None
    while True:
        try:
            msg, payload = channel.recv()
        except ChannelClosed:
            break
        if isinstance(msg, m.Infer):
            assert runner is not None, "Infer before Load"
            done, buffers = runner.infer(msg, payload)
            channel.send(done, buffers)
        elif isinstance(msg, m.Release):
            if runner is not None:
                runner.release(msg.offsets)
        elif isinstance(msg, m.Load):
            runner = load(channel, msg, runner)
        elif isinstance(msg, m.Shutdown):
            if runner is not None:
                runner.finalize()
                runner = None
            channel.send(m.Closed())
            break
    if runner is not None:
        runner.finalize()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dlserve-worker")
    parser.add_argument("--fd", type=int, required=True)
    args = parser.parse_args(argv)
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server decides when we stop
    install_pb_utils()
    sock = socket.socket(fileno=args.fd)
    channel: Channel = BlockingChannel(sock, codec.to_worker)
    serve(channel)
    channel.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
