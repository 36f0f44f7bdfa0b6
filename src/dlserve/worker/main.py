"""Entry point of a worker process: ``python -m dlserve.worker.main --fd N ...``.

The worker imports only dlserve's model-side packages and the user's code. It
serves one connection (an inherited socket) until the server says Shutdown or
goes away. Its two arenas arrive as inherited memfds: they have no name, so
nothing is left in /dev/shm however either process ends.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import socket
import sys
from collections.abc import Callable
from typing import Any

from dlserve import pb_utils as backend
from dlserve.ipc import codec
from dlserve.ipc import messages as m
from dlserve.ipc.channel import BlockingChannel, ChannelClosed
from dlserve.ipc.log_environment import log_settings_env
from dlserve.pb_utils import runtime
from dlserve.tensors import heap
from dlserve.tensors.arena import ShmSegment
from dlserve.worker.bls.direct_callee import serve_direct
from dlserve.worker.link import link
from dlserve.worker.link.link import WorkerLink
from dlserve.worker.pb_utils_runtime import WORKER_RUNTIME
from dlserve.worker.runner import LoadError, ModelRunner

Channel = BlockingChannel[m.ServerToWorker]
Arenas = tuple[ShmSegment, ShmSegment]  # (input arena, output arena)


def _die_with_parent() -> None:
    """Ask the kernel to SIGKILL this worker when the server process dies (Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _default_signals() -> None:
    """A process the model forks (multiprocessing's 'fork' start method) is the model's,
    not the server's: SIGTERM ends it again (``Pool.terminate`` waits for that), SIGINT
    raises KeyboardInterrupt, as in any Python program."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def install_pb_utils() -> None:
    """Make ``import triton_python_backend_utils`` find dlserve's implementation, and give
    it this worker's runtime (what it asks of the server goes over the link)."""
    sys.modules["triton_python_backend_utils"] = backend
    runtime.install(WORKER_RUNTIME)


def load(
    worker: WorkerLink, msg: m.Load, runner: ModelRunner | None, arenas: Arenas
) -> ModelRunner | None:
    worker.model_name = msg.model_name
    worker.instance = m.chain_entry(msg.model_name, msg.model_version, msg.instance_name)
    worker.serving = False  # no BLS while the model initializes
    if runner is not None:
        runner.update(msg)
    else:
        runner = ModelRunner(msg, arenas)
    worker.on_cancel = runner.cancellation.cancel
    worker.on_release = runner.release
    worker.memory = runner.bls_memory
    runner.link = worker  # execute() runs on the serve loop's thread: its link
    try:
        runner.start()
    except LoadError as exc:
        runner.finalize()
        worker.send(m.LoadFailed(message=str(exc)))
        return None
    worker.serving = msg.initialize
    worker.send(m.Loaded(config_json=json.dumps(runner.config), pid=os.getpid()))
    return runner


def serve(
    channel: Channel, arenas: Arenas, fd_socket: socket.socket | None = None, *,
    process_wide: bool = False,
) -> None:  # fmt: skip
    """Serve one connection until Shutdown or until the server goes away.

    Model code reaches the server through this thread's WorkerLink (pb_utils metrics);
    ``process_wide`` also makes it the default for threads the model starts.
    ``fd_socket``: where the server hands over the sockets of direct BLS calls.
    """
    worker = WorkerLink(channel, fd_socket)
    link.install(worker, process_wide=process_wide)
    try:
        _Serving(worker, arenas).run()
    finally:
        link.uninstall(worker)


class _Serving:
    """The serve loop's state: the link and the model instance it runs (after Load)."""

    def __init__(self, worker: WorkerLink, arenas: Arenas) -> None:
        self.worker = worker
        self.arenas = arenas
        self.runner: ModelRunner | None = None
        self.stopped = False  # the server has said Shutdown
        # each frame the server sends the serve loop, by type (any other: nothing to do)
        self._handlers: dict[type, Callable[[Any, memoryview], None]] = {
            m.Infer: self._infer,
            m.InferBatch: self._infer_batch,
            m.Release: self._release,
            m.UnmapRegions: self._unmap_regions,
            m.LogSettings: self._log_settings,
            m.DropArenas: self._drop_arenas,
            m.Load: self._load,
            m.Shutdown: self._shutdown,
        }

    def run(self) -> None:
        """Handle frames until Shutdown or until the server goes away; finalize either way."""
        try:
            while not self.stopped:
                self.step()
        except ChannelClosed:
            pass
        finally:
            self.worker.serving = False  # no BLS while the model finalizes
            if self.runner is not None:
                self.runner.finalize()
            for arena in self.arenas:
                arena.close()
            self.worker.close_direct()

    def step(self) -> None:
        """Handle one frame."""
        (msg, payload), direct = self.worker.next_work()
        if direct is not None:  # from a worker calling this instance directly
            if self.runner is not None:
                serve_direct(self.runner, self.worker, direct, msg, payload)
            return
        try:
            handler = self._handlers[type(msg)]
        except KeyError:  # a MetricValueReply here answers a call that gave up waiting
            return
        handler(msg, payload)

    def _infer(self, msg: m.Infer, payload: memoryview) -> None:
        assert self.runner is not None, "Infer before Load"
        replies = self.runner.execute((msg,), msg.release, payload)
        if replies:  # none: a decoupled model's responses went out already
            self.worker.send(*replies[0])

    def _infer_batch(self, msg: m.InferBatch, payload: memoryview) -> None:
        assert self.runner is not None, "InferBatch before Load"
        self.worker.send_many(self.runner.execute(msg.items, msg.release, payload))

    def _release(self, msg: m.Release, payload: memoryview) -> None:
        if self.runner is not None:
            self.runner.release(msg.offsets, msg.gpu)

    def _unmap_regions(self, msg: m.UnmapRegions, payload: memoryview) -> None:
        if self.runner is not None:
            self.runner.unmap_regions(msg.regions)

    def _log_settings(self, msg: m.LogSettings, payload: memoryview) -> None:
        os.environ.update(
            log_settings_env(msg.verbose, msg.info, msg.warning, msg.error, msg.iso8601)
        )

    def _drop_arenas(self, msg: m.DropArenas, payload: memoryview) -> None:
        if self.runner is not None:
            self.runner.drop_arenas(msg.arenas)

    def _load(self, msg: m.Load, payload: memoryview) -> None:
        self.runner = load(self.worker, msg, self.runner, self.arenas)

    def _shutdown(self, msg: m.Shutdown, payload: memoryview) -> None:
        self.worker.served.close_all()  # direct callers go through the server now
        runner, self.runner = self.runner, None
        self.worker.serving = False  # no BLS while the model finalizes
        if runner is not None:
            runner.finalize()
        self.worker.send(m.Closed())
        self.stopped = True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dlserve-worker")
    parser.add_argument("--fd", type=int, required=True, help="the connection to the server")
    parser.add_argument("--input-arena-fd", type=int, required=True)
    parser.add_argument("--output-arena-fd", type=int, required=True)
    parser.add_argument("--fd-socket", type=int, default=-1, help="descriptors from the server")
    parser.add_argument("--poll-us", type=int, default=0, help="poll for a frame before sleeping")
    parser.add_argument(
        "--huge-pages", action="store_true", help="transparent huge pages back on (the server's"
        " own setting turned them off)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    # The model sees the command line Triton's stub gives it (its embedded interpreter has
    # none): argparse or unittest.main() in a model must not find the worker's options.
    sys.argv = [""]
    _die_with_parent()
    # The server decides when we stop: Ctrl-C in a terminal, systemd and `timeout` signal
    # the whole process group, and the requests in flight must still finish. A worker
    # whose server dies gets SIGKILL (_die_with_parent).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.register_at_fork(after_in_child=_default_signals)
    install_pb_utils()
    heap.keep_large_buffers()  # a model's large outputs reuse their pages request to request
    if args.huge_pages:
        heap.huge_pages_again()
    sock = socket.socket(fileno=args.fd)
    spin_ns = args.poll_us * 1000
    channel: Channel = BlockingChannel(sock, codec.to_worker, spin_ns=spin_ns)
    fd_socket = socket.socket(fileno=args.fd_socket) if args.fd_socket >= 0 else None
    arenas = (
        ShmSegment.from_fd(args.input_arena_fd, "input-arena"),
        ShmSegment.from_fd(args.output_arena_fd, "output-arena"),
    )
    profile_dir = os.environ.get("DLSERVE_WORKER_PROFILE")
    if profile_dir:  # a developer's switch: cProfile each worker into this folder
        import cProfile

        cProfile.runctx(
            "serve(channel, arenas, fd_socket, process_wide=True)",
            globals(),
            {"channel": channel, "arenas": arenas, "fd_socket": fd_socket},
            os.path.join(profile_dir, f"worker-{os.getpid()}.prof"),
        )
    else:
        serve(channel, arenas, fd_socket, process_wide=True)
    channel.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
