"""The shared-memory regions clients registered: register, look up, count, unregister.

A system region is ``byte_size`` bytes of a client's POSIX shared-memory object (its key)
from ``offset``. The server process never maps one: it opens the object only to check its
size at registration. A CUDA region is the first ``byte_size`` bytes of a client's GPU
allocation, named by its CUDA IPC handle; the server opens the handle once at registration
to check it (the device, the allocation's size) and closes it again. Each worker maps a
region the first time a request brings it one and keeps the mapping until the region goes
(``worker/client_regions.py``). Both kinds share one namespace of names, as in Triton.

Unregistering a region that requests are using succeeds at once, as in Triton: the region
stays (listed by status, usable by requests) until its last request has finished; then it
goes, and every worker that mapped it is told to unmap it.

Codes and messages are Triton's (``src/shared_memory_manager.cc``, ``src/common.cc``) where
clients may match on them. Unlike Triton, any offset works, page-aligned or not, and who may
register is a policy (``allow_client_shm``): local peers only by default.
"""

from __future__ import annotations

import functools
import ipaddress
import itertools
import os
import time
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final, Literal, Protocol

from dlserve import errors
from dlserve.tensors.arena import object_size, open_client_object
from dlserve.types import (
    ArenaSpan,
    CudaSpan,
    InferRequest,
    Peer,
    RegionRef,
    RegionSpan,
    RegionStatus,
)

AllowClientShm = Literal["local", "false", "any"]
ALLOW_CLIENT_SHM: Final = ("local", "false", "any")
# Key prefixes a client may not register: Triton's Python backend's, and dlserve's own.
RESERVED_PREFIXES: Final = ("triton_python_backend_shm_region_", "dlserve_")
SIZE_MAX: Final = 2**64 - 1  # Triton's size_t: the HTTP frontend accepts uint64 values

DISABLED: Final = (
    "Client shared memory is disabled. Start the server with '--allow-client-shm=local' "
    "or '--allow-client-shm=any' to enable."
)


class RegionUser(Protocol):
    """A worker that may map regions: told when one it mapped is gone."""

    def unmap_regions(self, regions: list[int]) -> None: ...


@dataclass(slots=True, eq=False)
class Region:
    name: str
    key: str
    offset: int
    byte_size: int
    id: int
    handle: bytes = b""  # CUDA: the allocation's cudaIpcMemHandle_t
    device: int = -1  # CUDA: its GPU; -1 for system shared memory
    uses: int = 0  # requests in flight that use it
    unregistered: bool = False  # goes once ``uses`` is back to 0
    users: weakref.WeakSet[RegionUser] = field(default_factory=weakref.WeakSet)
    # The local processes it belongs to (server/core/shm/owners.py); reclaimed when the last exits.
    owners: set[int] = field(default_factory=set)
    last_used: float = field(default_factory=time.monotonic)  # for --shm-idle-timeout

    def span(self, ref: RegionRef) -> RegionSpan:
        """Where ``ref``'s bytes are in the object, checked as Triton checks them."""
        name, offset, size = self.name, ref.offset, ref.byte_size
        if offset < 0 or offset >= self.byte_size:
            raise errors.InvalidArgumentError(f"Invalid offset for shared memory region: '{name}'")
        if size > SIZE_MAX - offset:
            raise errors.InvalidArgumentError(
                f"Integer overflow detected: byte_size ({size}) + offset ({offset}) exceeds "
                f"maximum value ({SIZE_MAX}) for region '{name}'"
            )
        if size < 0 or offset + size > self.byte_size:
            raise errors.InvalidArgumentError(
                f"Invalid offset + byte size for shared memory region: '{name}'"
            )
        return RegionSpan(self.id, self.key, self.offset + offset, size, self.handle, self.device)

    @property
    def is_cuda(self) -> bool:
        return self.device >= 0

    def status(self) -> RegionStatus:
        return RegionStatus(self.name, self.key, self.offset, self.byte_size, self.device)


@dataclass(slots=True)
class RegionLease:
    """The regions one request uses, counted as in use until it is released."""

    inputs: Mapping[str, RegionSpan | ArenaSpan | CudaSpan]  # BLS: a caller's memory
    outputs: Mapping[str, RegionSpan]
    regions: list[Region]

    @property
    def device(self) -> int | None:
        """The GPU of the request's first CUDA input, if it has one (it decides routing)."""
        for span in self.inputs.values():
            if isinstance(span, CudaSpan) or (isinstance(span, RegionSpan) and span.is_cuda):
                return span.device
        return None

    def bind(self, worker: RegionUser) -> None:
        """``worker`` gets these regions: it is told to unmap them when they go."""
        for region in self.regions:
            region.users.add(worker)


@functools.lru_cache(maxsize=4096)  # asked for every request that names a region
def is_local(peer: Peer | None) -> bool:
    """Whether ``peer`` is on this host: a Unix socket or a loopback address."""
    if peer is None:
        return False
    if peer.address is None:
        return True
    try:
        address = ipaddress.ip_address(peer.address)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


class RegionRegistry:
    def __init__(self, allow: AllowClientShm = "local") -> None:
        if allow not in ALLOW_CLIENT_SHM:
            raise ValueError(f"allow_client_shm must be one of {ALLOW_CLIENT_SHM}, not {allow!r}")
        self.allow = allow
        self._regions: dict[str, Region] = {}
        self._ids = itertools.count(1)

    # -- the control calls --------------------------------------------------------------
    def check_peer(self, peer: Peer | None) -> None:
        """Refuse a register or unregister call that the policy does not allow."""
        if self.allow == "false":
            raise errors.UnsupportedError(DISABLED)
        if self.allow == "local" and not is_local(peer):
            where = (peer and peer.address) or "an unknown peer"
            raise errors.UnsupportedError(
                "Client shared memory is accepted from local clients only (loopback or a Unix "
                f"socket); this request came from '{where}'. Start the server with "
                "'--allow-client-shm=any' to accept it from anywhere."
            )

    def check_new(self, name: str, peer: Peer | None, what: str = "system shared memory") -> None:
        """Refuse a registration before anything is opened: policy, name, duplicates."""
        self.check_peer(peer)
        if not name:
            raise errors.InvalidArgumentError(
                f"'region name' is necessary to register {what} region"
            )
        if name in self._regions:
            raise errors.AlreadyExistsError(f"shared memory region '{name}' already in manager")

    def register(
        self, name: str, key: str, offset: int, byte_size: int, peer: Peer | None,
        owners: Iterable[int] = (),
    ) -> None:  # fmt: skip
        self.check_new(name, peer)
        _check_key(name, key)
        size = _object_size(key)
        if offset < 0 or byte_size < 0 or offset + byte_size > size:
            raise errors.InvalidArgumentError(
                f"failed to register shared memory region '{name}': invalid args"
            )
        region = Region(name, key, offset, byte_size, next(self._ids), owners=set(owners))
        self._regions[name] = region

    def add_cuda(
        self, name: str, handle: bytes, device: int, byte_size: int, owners: Iterable[int] = ()
    ) -> None:
        """Add a CUDA region whose handle the caller has checked (``check_new`` first)."""
        if name in self._regions:  # registered meanwhile, while the handle was checked
            raise errors.AlreadyExistsError(f"shared memory region '{name}' already in manager")
        region = Region(name, "", 0, byte_size, next(self._ids), handle=handle, device=device,
                        owners=set(owners))  # fmt: skip
        self._regions[name] = region

    def unregister(self, name: str, peer: Peer | None, cuda: bool = False) -> None:
        """Unregister ``name`` (every region of the kind when ""); an unknown name, or one
        of the other kind, is not an error (as in Triton)."""
        self.check_peer(peer)
        names = [name] if name else list(self._regions)
        for each in names:
            region = self._regions.get(each)
            if region is not None and region.is_cuda == cuda:
                self._unregister(region)

    def _unregister(self, region: Region) -> None:
        """As an unregister call does: now, or once its last request is over."""
        region.unregistered = True
        if region.uses == 0:
            self._remove(region)

    # -- reclaim (server/core/shm/owners.py decides when) ------------------------------------------
    def reclaim(self, pid: int) -> list[str]:
        """Process ``pid`` exited: unregister the regions (of either kind) no living owner
        is left to."""
        gone: list[str] = []
        for region in list(self._regions.values()):
            if pid in region.owners:
                region.owners.discard(pid)
                if not region.owners and not region.unregistered:
                    gone.append(region.name)
                    self._unregister(region)
        return gone

    def drop_idle(self, unused_since: float) -> list[str]:
        """Unregister the regions no request has used since ``unused_since`` (monotonic)."""
        gone: list[str] = []
        for region in list(self._regions.values()):
            if region.uses == 0 and not region.unregistered and region.last_used < unused_since:
                gone.append(region.name)
                self._unregister(region)
        return gone

    def sizes(self) -> list[tuple[str, int]]:
        """(kind, byte size) of every region held now: ``system`` or ``cuda`` (metrics)."""
        return [("cuda" if r.is_cuda else "system", r.byte_size) for r in self._regions.values()]

    def owned(self) -> set[int]:
        """Every process that owns a region."""
        return {pid for region in self._regions.values() for pid in region.owners}

    def status(self, name: str = "", cuda: bool = False) -> list[RegionStatus]:
        """The regions of one kind (system, or CUDA), or the one named; Triton's messages."""
        if name:
            region = self._regions.get(name)
            if region is None:
                kind = "cuda" if cuda else "system"
                raise errors.NotFoundError(f"Unable to find {kind} shared memory region: '{name}'")
            if region.is_cuda != cuda:
                registered, asked = ("system", "CUDA") if cuda else ("CUDA", "system")
                raise errors.NotFoundError(
                    f"The region named '{name}' is registered as {registered} shared memory, "
                    f"not {asked} shared memory"
                )
            regions: Iterable[Region] = [region]
        else:
            regions = sorted(
                (r for r in self._regions.values() if r.is_cuda == cuda), key=lambda r: r.name
            )
        return [r.status() for r in regions]

    # -- inference ----------------------------------------------------------------------
    def lease(self, request: InferRequest) -> RegionLease | None:
        """The spans of the request's tensors in regions, counted as in use until
        :meth:`release`; None when the request names no region."""
        inputs = {t.name: t.region for t in request.inputs if t.region is not None}
        outputs = {o.name: o.region for o in request.outputs if o.region is not None}
        if not inputs and not outputs:
            return None
        if self.allow == "local":
            self.check_peer(request.peer)  # a remote client may not use local clients' memory
        input_spans = {name: self._find(ref).span(ref) for name, ref in inputs.items()}
        output_spans = {name: self._find(ref).span(ref) for name, ref in outputs.items()}
        names = {ref.region for ref in (*inputs.values(), *outputs.values())}
        regions = [self._regions[name] for name in names]
        now = time.monotonic()
        for region in regions:
            region.uses += 1
            region.last_used = now
        return RegionLease(input_spans, output_spans, regions)

    def lease_spans(
        self,
        spans: dict[str, tuple[int, int, int]],
        arenas: Mapping[str, ArenaSpan | CudaSpan],
    ) -> RegionLease:
        """A lease of regions a BLS call passes on by reference (by region id, offset in the
        object or allocation, byte size): the caller's own request holds them, this one too.
        ``arenas``: inputs in the caller's arenas, passed on as they are."""
        by_id = {r.id: r for r in self._regions.values()}
        checked: dict[str, RegionSpan | ArenaSpan | CudaSpan] = dict(arenas)
        regions: dict[int, Region] = {}
        for name, (region_id, offset, size) in spans.items():
            region = by_id.get(region_id)
            if region is None:
                raise errors.NotFoundError(
                    f"the shared memory region holding input '{name}' was unregistered"
                )
            checked[name] = RegionSpan(region_id, region.key, offset, size, region.handle,
                                       region.device)  # fmt: skip
            regions[region_id] = region
        for region in regions.values():
            region.uses += 1
        return RegionLease(checked, {}, list(regions.values()))

    def bind(self, region_ids: list[int], worker: RegionUser) -> list[int]:
        """``worker`` mapped these regions (for a BLS call that did not pass through the
        server): it is told to unmap each when it goes. Returns the ids already gone."""
        by_id = {r.id: r for r in self._regions.values()}
        gone: list[int] = []
        for region_id in region_ids:
            region = by_id.get(region_id)
            if region is None:
                gone.append(region_id)
            else:
                region.users.add(worker)
        return gone

    def release(self, lease: RegionLease) -> None:
        """The request is over: its regions that were unregistered meanwhile may go."""
        now = time.monotonic()
        for region in lease.regions:
            region.uses -= 1
            region.last_used = now
            if region.uses == 0 and region.unregistered:
                self._remove(region)

    def _find(self, ref: RegionRef) -> Region:
        region = self._regions.get(ref.region)
        if region is None:
            raise errors.NotFoundError(f"Unable to find shared memory region: '{ref.region}'")
        return region

    def _remove(self, region: Region) -> None:
        if self._regions.get(region.name) is region:
            del self._regions[region.name]
        for user in list(region.users):
            user.unmap_regions([region.id])
        region.users.clear()


def _check_key(name: str, key: str) -> None:
    """Triton's key rules: not only slashes, no reserved prefix (after the slashes)."""
    stripped = key.lstrip("/")
    if not stripped:
        raise errors.InvalidArgumentError(
            f"cannot register shared memory region '{name}' - invalid shm key '{key}'"
        )
    for prefix in RESERVED_PREFIXES:
        if stripped.startswith(prefix):
            raise errors.InvalidArgumentError(
                f"cannot register shared memory region '{name}' with key '{key}' as the key "
                f"contains the reserved prefix '{prefix}'"
            )


def _object_size(key: str) -> int:
    """The size of the client's object now; it is opened only to ask."""
    try:
        fd = open_client_object(key)
    except (OSError, ValueError):
        raise errors.InternalError(f"Unable to open shared memory region: '{key}'") from None
    try:
        return object_size(fd)
    finally:
        os.close(fd)
