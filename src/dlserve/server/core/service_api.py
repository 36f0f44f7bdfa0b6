"""Two parts of the service's API that stand apart from inference: client shared-memory
regions, and the model repository (index, load, unload). The service owns one of each
(``InferenceService.shared_memory``, ``InferenceService.repository_api``), and the
frontends reach them through it."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from dlserve import errors
from dlserve.server.core.models.manager import ModelEntry, ModelManager
from dlserve.server.core.models.repository import Repository
from dlserve.server.core.shm import cuda_check
from dlserve.server.core.shm.owners import RegionOwners
from dlserve.server.core.shm.registry import RegionRegistry
from dlserve.types import ModelState, Peer, RegionStatus, RepositoryEntry


class SharedMemoryApi:
    """System and CUDA shared memory: register, unregister, status."""

    def __init__(self, regions: RegionRegistry, owners: RegionOwners) -> None:
        self.regions = regions
        self.owners = owners

    def status(self, name: str = "", cuda: bool = False) -> list[RegionStatus]:
        return self.regions.status(name, cuda)

    async def register(self, name: str, key: str, offset: int, byte_size: int, peer: Peer) -> None:
        """Register the region; it belongs to the local process that asked, if one can be
        told (``server/core/shm/owners.py``), and is reclaimed when that process exits."""
        self.regions.check_new(name, peer)  # before the owner is looked for
        owners = await self.owners.owners_of(peer)
        self.regions.register(name, key, offset, byte_size, peer, owners)
        self.owners.watch(owners)

    async def register_cuda(
        self, name: str, raw_handle: bytes, device_id: int, byte_size: int, peer: Peer
    ) -> None:
        """Register a CUDA region once its handle is checked (off the event loop: the
        first open creates the server's CUDA context); it belongs to the local process that
        asked, as a system region does."""
        self.regions.check_new(name, peer, "cuda shared memory")
        cuda_check.check_handle_bytes(raw_handle)
        owners = await self.owners.owners_of(peer)
        await asyncio.to_thread(
            cuda_check.check_registration, name, raw_handle, device_id, byte_size
        )
        self.regions.add_cuda(name, raw_handle, device_id, byte_size, owners)
        self.owners.watch(owners)

    def unregister(self, name: str, peer: Peer, cuda: bool = False) -> None:
        """Unregister ``name``, or every region of the kind when it is ""."""
        self.regions.unregister(name, peer, cuda)


class RepositoryApi:
    """The repository extension: the index, and explicit load and unload (only in the
    explicit model control mode: ``control_mode`` is "none", "explicit" or "poll")."""

    def __init__(self, repository: Repository, manager: ModelManager, control_mode: str) -> None:
        self.repository = repository
        self.manager = manager
        self.control_mode = control_mode

    def index(self, ready_only: bool = False) -> list[RepositoryEntry]:
        result: list[RepositoryEntry] = []
        for name in sorted(set(self.repository.model_names()) | set(self.manager.models)):
            entry = self.manager.entry(name)
            if entry is None:
                if not ready_only:
                    result.append(RepositoryEntry(name, "", None, ""))
                continue
            result.extend(_index_rows(entry, ready_only))
        return result

    def _check_explicit(self) -> None:
        if self.control_mode != "explicit":
            raise errors.UnavailableError(
                "explicit model load / unload is not allowed if polling is enabled"
            )

    async def load(
        self, name: str, config_json: str | None = None, files: Mapping[str, bytes] | None = None
    ) -> None:
        """Load (or reload) ``name``: from the repository, or from ``files`` sent with the
        request (``file:<path>`` -> bytes, with ``config``)."""
        self._check_explicit()
        await self.manager.load(name, config_json, files)

    async def unload(self, name: str) -> None:
        self._check_explicit()
        await self.manager.unload(name)


def _index_rows(entry: ModelEntry, ready_only: bool) -> list[RepositoryEntry]:
    if entry.versions:
        return [
            RepositoryEntry(
                entry.name,
                str(v),
                entry.state if mv.ready else ModelState.UNAVAILABLE,
                entry.reason,
            )
            for v, mv in sorted(entry.versions.items())
            if not ready_only or (mv.ready and entry.state == ModelState.READY)
        ]
    if ready_only:
        return []
    return [RepositoryEntry(entry.name, "", entry.state, entry.reason)]
