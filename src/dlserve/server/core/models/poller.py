"""``--model-control-mode poll``: the repository is looked at every ``--repository-poll-secs``
and the server follows it, as Triton does in POLL mode.

- a model folder that appears is loaded;
- one whose files changed (a file added, removed, resized or rewritten) is reloaded: the
  loaded model serves until the new one is ready, and stays if it cannot start;
- one that disappears is unloaded (its in-flight requests finish first).

A model is judged by the names, sizes and modification times of every file below its
folder. What a poll saw is remembered whether its load worked or not: a model that failed
is tried again only once its files change again. As in Triton, nothing synchronizes a
poll with whoever edits the repository: copy a model in whole (or rename it into place).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

from dlserve import errors
from dlserve.server.core.models.repository import Repository

log = logging.getLogger("dlserve.models")

Fingerprint = frozenset[tuple[str, int, int]]  # (relative path, size, mtime in ns)
Load = Callable[[str], Awaitable[None]]


def fingerprint(folder: Path) -> Fingerprint:
    """What a model's folder holds now; empty when it cannot be read."""
    seen: set[tuple[str, int, int]] = set()
    for directory, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(directory, name)
            try:
                stat = os.stat(path)
            except OSError:  # removed while we looked: the next poll sees the rest
                continue
            seen.add((os.path.relpath(path, folder), stat.st_size, stat.st_mtime_ns))
    return frozenset(seen)


class RepositoryPoller:
    """Compares the repository with what it saw last and loads, reloads and unloads."""

    def __init__(
        self, repository: Repository, interval: float, load: Load, unload: Load,
        is_ensemble: Callable[[str], bool],
    ) -> None:  # fmt: skip
        self.repository = repository
        self.interval = interval
        self._load, self._unload, self._is_ensemble = load, unload, is_ensemble
        self._seen: dict[str, Fingerprint] = {}
        self._task: asyncio.Task[None] | None = None

    def remember(self, names: Iterable[str]) -> None:
        """The models loaded at startup, as they are now."""
        for name in names:
            self._seen[name] = fingerprint(self.repository.root / name)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.poll()
            except Exception:  # a poll must never end polling
                log.exception("polling the model repository failed")

    async def poll(self) -> None:
        """One look at the repository: load what is new or changed, unload what is gone."""
        now = {name: fingerprint(self.repository.root / name)
               for name in self.repository.model_names()}  # fmt: skip
        gone = [name for name in self._seen if name not in now]
        changed = [name for name, seen in now.items() if self._seen.get(name) != seen]
        self._seen = now
        for name in gone:
            log.info("model '%s' left the repository: unloading it", name)
            await self._unload(name)
        # one at a time, in name order; the models ensembles are made of first
        ensembles = [n for n in changed if self._is_ensemble(n)]
        for name in [*(n for n in changed if n not in ensembles), *ensembles]:
            await self._try_load(name)

    async def _try_load(self, name: str) -> None:
        log.info("model '%s' is new or changed in the repository: loading it", name)
        try:
            await self._load(name)
        except errors.DlserveError:
            pass  # said by the manager; the model is UNAVAILABLE, or serves on as it was
