"""A model instance's asyncio event loop: the ``async def`` methods of its model run there.

As in Triton's stub, the loop runs in a thread of its own from the first coroutine to the
instance's end, so tasks a coroutine starts (``asyncio.create_task``) go on after it has
returned, and a decoupled model's ``execute`` coroutines run side by side: the serve loop
starts one and goes on to the next request while it awaits.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Final

from dlserve.worker.link import link

# Threads for ``asyncio.to_thread`` (a BLS ``async_exec`` waits in one): made as needed, so
# the cap only bounds how many awaits may wait at once, not what idles. asyncio's default
# (CPU count + 4) would queue the ninth concurrent ``async_exec`` of a 4-CPU machine behind
# the first eight.
WAIT_THREADS: Final = 256
STOP_TIMEOUT_S: Final = 10.0  # for the tasks still running when the instance stops

Done = Callable[["asyncio.Task[Any]"], None]


class ModelLoop:
    """The loop and its thread, started at the first coroutine."""

    def __init__(self, worker: Callable[[], link.WorkerLink | None]) -> None:
        """``worker``: the instance's link, which the loop's thread makes its own (model
        code on it calls the server through it)."""
        self._worker = worker
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._tasks: set[asyncio.Task[Any]] = set()  # started in the background, running
        self._lock = threading.Lock()

    def _running(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                loop.set_default_executor(
                    concurrent.futures.ThreadPoolExecutor(WAIT_THREADS, "dlserve-await")
                )
                self._thread = threading.Thread(
                    target=self._run, args=(loop,), name="dlserve-model-loop", daemon=True
                )
                self._thread.start()
                self._loop = loop
            return self._loop

    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        worker = self._worker()
        if worker is not None:
            link.install(worker)  # an in-process worker's link is per thread
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            if worker is not None:
                link.uninstall(worker)

    def run(self, awaitable: Awaitable[Any]) -> Any:
        """Run ``awaitable`` on the loop and wait for its result (or exception)."""
        return asyncio.run_coroutine_threadsafe(_awaited(awaitable), self._running()).result()

    def start(
        self, coroutine: Coroutine[Any, Any, Any], context: contextvars.Context, done: Done
    ) -> None:
        """Run ``coroutine`` on the loop in ``context`` without waiting for it; ``done`` is
        called on the loop's thread with its task when it ends."""
        loop = self._running()

        def create() -> None:
            task = loop.create_task(coroutine, context=context)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            task.add_done_callback(done)

        loop.call_soon_threadsafe(create)

    def close(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """The instance ends: the tasks still running are cancelled (and given ``timeout``
        to finish), then the loop stops and its thread ends."""
        with self._lock:
            loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
        if loop is None or thread is None:
            return
        with contextlib.suppress(concurrent.futures.TimeoutError, RuntimeError):
            asyncio.run_coroutine_threadsafe(_cancel_all(), loop).result(timeout)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout)
        if not thread.is_alive():
            loop.close()


async def _awaited(awaitable: Awaitable[Any]) -> Any:
    return await awaitable


async def _cancel_all() -> None:
    """Cancel every task of this loop but this one, and wait for them to end."""
    current = asyncio.current_task()
    tasks = [task for task in asyncio.all_tasks() if task is not current]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
