"""The system shared-memory regions clients registered: register, look up, count, unregister.

A region is ``byte_size`` bytes of a client's POSIX shared-memory object (its key) from
``offset``. The server process never maps one: it opens the object only to check its size
at registration. Each worker maps a region the first time a request brings it one and keeps
the mapping until the region goes (``workers/regions.py``).

Unregistering a region that requests are using succeeds at once, as in Triton: the region
stays (listed by status, usable by requests) until its last request has finished; then it
goes, and every worker that mapped it is told to unmap it.

Codes and messages are Triton's (``src/shared_memory_manager.cc``, ``src/common.cc``) where
clients may match on them. Unlike Triton, any offset works, page-aligned or not, and who may
register is a policy (``allow_client_shm``): local peers only by default.
"""

from __future__ import annotations

import ipaddress
import itertools
import os
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final, Literal, Protocol

from dlserve import errors
from dlserve.tensors.shm import object_size, open_client_object
from dlserve.types import InferRequest, Peer, RegionRef, RegionSpan, RegionStatus

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
    uses: int = 0  # requests in flight that use it
    unregistered: bool = False  # goes once ``uses`` is back to 0
    users: weakref.WeakSet[RegionUser] = field(default_factory=weakref.WeakSet)
    # The local processes it belongs to (core/owners.py); reclaimed when the last exits.
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
        return RegionSpan(self.id, self.key, self.offset + offset, size)


@dataclass(slots=True)
class RegionLease:
    """The regions one request uses, counted as in use until it is released."""

    inputs: dict[str, RegionSpan]
    outputs: dict[str, RegionSpan]
    regions: list[Region]

    def bind(self, worker: RegionUser) -> None:
        """``worker`` gets these regions: it is told to unmap them when they go."""
        for region in self.regions:
            region.users.add(worker)


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

    def register(
        self, name: str, key: str, offset: int, byte_size: int, peer: Peer | None,
        owners: Iterable[int] = (),
    ) -> None:  # fmt: skip
        self.check_peer(peer)
        if not name:
            raise errors.InvalidArgumentError(
                "'region name' is necessary to register system shared memory region"
            )
        _check_key(name, key)
        if name in self._regions:
            raise errors.AlreadyExistsError(f"shared memory region '{name}' already in manager")
        size = _object_size(key)
        if offset < 0 or byte_size < 0 or offset + byte_size > size:
            raise errors.InvalidArgumentError(
                f"failed to register shared memory region '{name}': invalid args"
            )
        region = Region(name, key, offset, byte_size, next(self._ids), owners=set(owners))
        self._regions[name] = region

    def unregister(self, name: str, peer: Peer | None) -> None:
        """Unregister ``name`` (every region when ""); an unknown name is not an error."""
        self.check_peer(peer)
        names = [name] if name else list(self._regions)
        for each in names:
            region = self._regions.get(each)
            if region is not None:
                self._unregister(region)

    def _unregister(self, region: Region) -> None:
        """As an unregister call does: now, or once its last request is over."""
        region.unregistered = True
        if region.uses == 0:
            self._remove(region)

    # -- reclaim (core/owners.py decides when) ------------------------------------------
    def reclaim(self, pid: int) -> list[str]:
        """Process ``pid`` exited: unregister the regions no living owner is left to."""
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

    def owned(self) -> set[int]:
        """Every process that owns a region."""
        return {pid for region in self._regions.values() for pid in region.owners}

    def status(self, name: str = "") -> list[RegionStatus]:
        if name:
            region = self._regions.get(name)
            if region is None:
                raise errors.NotFoundError(f"Unable to find system shared memory region: '{name}'")
            regions: Iterable[Region] = [region]
        else:
            regions = sorted(self._regions.values(), key=lambda r: r.name)
        return [RegionStatus(r.name, r.key, r.offset, r.byte_size) for r in regions]

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
