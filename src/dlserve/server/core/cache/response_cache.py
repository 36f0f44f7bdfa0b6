"""Triton's response cache (its ``local`` cache): complete, successful responses kept in
the server's memory, so that a request the same as an earlier one is answered without
running the model.

One :class:`ResponseCache` per server (``--cache-config local,size=BYTES``), shared by
every model that enables ``response_cache``; each loaded model version sees it through a
:class:`ModelCache` with a key space of its own (its *owner* number), so a version never
sees another's responses, nor a reloaded model its predecessor's; the entries of a version
are dropped when it stops (unload, or replaced by a reload).

The key is a BLAKE2b-256 digest of what decides the response (``request_key``): the
owner, the model's name and version, each input's name, datatype, shape and bytes, the
outputs asked for (names, in order; "all" when none is named) and the request parameters
the model sees (all but ``priority`` and ``timeout``; the sequence id and flags too).
Triton hashes less (model, version, input names and bytes, 64 bits); the rest is there so
that no request gets another's answer. Classification is applied to a
cached response as to a computed one, so ``class_count`` needs no key of its own.

Requests whose tensors the server does not hold are neither looked up nor stored: inputs
or outputs in client shared memory (system or CUDA) and BLS calls (their tensors travel by
reference between workers). Everything runs on the event loop, so concurrent requests
cannot interleave inside the cache; large inputs are hashed, and large outputs copied into
an entry, on a thread (numpy's copy releases the GIL, ``bytes()`` would not).

Sizes: an entry costs what Triton's local cache packs for it (per output: name, datatype,
shape and bytes, with their lengths; ``packed_size``) plus ``ENTRY_OVERHEAD`` bytes for its
key and bookkeeping. Least recently used entries are evicted until a new one fits; one
larger than the whole cache is not stored.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import struct
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from dlserve.server.core.scheduling.scheduler import PRIORITY, TIMEOUT
from dlserve.server.core.telemetry.stats import ModelStats
from dlserve.tensors.copies import COPY_ON_LOOP_LIMIT, unlocked_copy
from dlserve.types import InferRequest, OutputTensor, Parameters

log = logging.getLogger("dlserve.models")

ENTRY_OVERHEAD: Final = 128  # the key (32 bytes) and the entry's bookkeeping, counted
HASH_ON_THREAD: Final = 1 << 20  # inputs of more bytes than this are hashed off the loop
# Parameters that only schedule a request: not in the key. The sequence ones are (a model
# without the sequence batcher still sees them as request.correlation_id() and flags()).
SCHEDULING: Final = frozenset((PRIORITY, TIMEOUT))
_U32: Final = struct.Struct("<I")
_U64: Final = struct.Struct("<Q")

Outputs = tuple[list[OutputTensor], Parameters]


@dataclass(frozen=True, slots=True)
class CachedTensor:
    name: str
    datatype: str
    shape: tuple[int, ...]
    data: bytes | memoryview  # bytes, or a read-only copy of the server's own


@dataclass(slots=True)
class CachedResponse:
    tensors: tuple[CachedTensor, ...]
    parameters: Parameters
    size: int
    owner: int

    def outputs(self) -> Outputs:
        """Fresh response objects over the cached bytes (which are immutable)."""
        outputs = [OutputTensor(t.name, t.datatype, t.shape, t.data) for t in self.tensors]
        return outputs, dict(self.parameters)


def packed_size(tensors: Iterable[CachedTensor | OutputTensor], parameters: Parameters) -> int:
    """The bytes an entry is charged: Triton's packed response, its parameters, overhead."""
    size = 4 + ENTRY_OVERHEAD
    for t in tensors:
        size += 8 + 4 + len(t.name.encode()) + 4 + len(t.datatype) + 4 + 8 * len(t.shape)
        size += 8 + (memoryview(t.data).nbytes if t.data is not None else 0)
    for key, value in parameters.items():
        size += len(key.encode()) + len(str(value).encode())
    return size


@dataclass(slots=True)
class ResponseCache:
    """The server's cache: an LRU of responses bounded by ``capacity`` bytes, with the
    counters Triton's local cache reports (``nv_cache_*``)."""

    capacity: int
    used: int = 0
    entries: OrderedDict[bytes, CachedResponse] = field(default_factory=OrderedDict)
    lookups: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    lookup_ns: int = 0
    insert_ns: int = 0
    _owners: dict[int, set[bytes]] = field(default_factory=dict)
    _next_owner: int = 1

    def open(self) -> int:
        """A new key space (one per loaded model version)."""
        owner = self._next_owner
        self._next_owner += 1
        self._owners[owner] = set()
        return owner

    def close(self, owner: int) -> None:
        """Drop the owner's entries; what it would store later is not stored."""
        for key in self._owners.pop(owner, ()):
            self._remove(key)

    def get(self, key: bytes) -> CachedResponse | None:
        start = time.monotonic_ns()
        self.lookups += 1
        entry = self.entries.get(key)
        if entry is None:
            self.misses += 1
        else:
            self.hits += 1
            self.entries.move_to_end(key)
        self.lookup_ns += time.monotonic_ns() - start
        return entry

    def put(self, key: bytes, owner: int, outputs: Outputs) -> bool:
        """Store a response; False when it is not stored (too large, in memory the server
        does not hold, its owner gone, or the key already there)."""
        start = time.monotonic_ns()
        try:
            size = self.admits(key, owner, outputs)
            return size is not None and self.insert(key, _entry(outputs, owner, size))
        finally:
            self.insert_ns += time.monotonic_ns() - start

    def admits(self, key: bytes, owner: int, outputs: Outputs) -> int | None:
        """The size of the entry ``outputs`` would make, or None when it is not stored."""
        if owner not in self._owners or key in self.entries:
            return None
        tensors, parameters = outputs
        if any(o.data is None or o.lent is not None for o in tensors):
            return None  # in a client's region, or in a worker's memory
        size = packed_size(tensors, parameters)
        return size if size <= self.capacity else None

    def insert(self, key: bytes, entry: CachedResponse) -> bool:
        """Store an entry made of an admitted response, evicting the least recently used
        to make room; False when its owner has gone or the key came meanwhile."""
        keys = self._owners.get(entry.owner)
        if keys is None or key in self.entries:
            return False
        while self.used + entry.size > self.capacity:
            oldest = next(iter(self.entries))
            self._remove(oldest)
            self.evictions += 1
        self.entries[key] = entry
        self.used += entry.size
        keys.add(key)
        return True

    def _remove(self, key: bytes) -> None:
        entry = self.entries.pop(key, None)
        if entry is None:
            return
        self.used -= entry.size
        keys = self._owners.get(entry.owner)
        if keys is not None:
            keys.discard(key)


def _entry(outputs: Outputs, owner: int, size: int) -> CachedResponse:
    """The response's outputs, copied (bytes stay as they are: they cannot change)."""
    tensors = tuple(
        CachedTensor(o.name, o.datatype, tuple(o.shape), _copied(o.data or b""))
        for o in outputs[0]
    )  # fmt: skip
    return CachedResponse(tensors, dict(outputs[1]), size, owner)


def _copied(data: bytes | memoryview) -> bytes | memoryview:
    """``data`` if it is bytes, else a copy: numpy's for a large one (it releases the GIL
    while it copies, so a copy on a thread does not hold the event loop)."""
    if type(data) is bytes:
        return data
    view = memoryview(data)
    if view.nbytes <= COPY_ON_LOOP_LIMIT:
        return view.tobytes()
    return unlocked_copy(view, readonly=True)  # as bytes: what is cached cannot change


def _to_copy(outputs: Outputs) -> int:
    """The bytes an entry of ``outputs`` copies."""
    return sum(memoryview(o.data).nbytes for o in outputs[0] if type(o.data) is not bytes
               and o.data is not None)  # fmt: skip


def cacheable(request: InferRequest) -> bool:
    """Whether the server holds every tensor of the request (none in shared memory)."""
    return all(t.data is not None and t.region is None for t in request.inputs) and all(
        o.region is None for o in request.outputs
    )


def request_key(owner: int, version: str, request: InferRequest) -> bytes:
    """The digest of what decides the response (see the module's docstring)."""
    digest = hashlib.blake2b(digest_size=32)
    update = digest.update
    update(_U64.pack(owner))
    _text(update, request.model_name)
    _text(update, version)
    update(_U32.pack(len(request.inputs)))
    for tensor in sorted(request.inputs, key=lambda t: t.name):
        _text(update, tensor.name)
        _text(update, tensor.datatype)
        update(_U32.pack(len(tensor.shape)))
        for dim in tensor.shape:
            update(_U64.pack(dim & 0xFFFFFFFFFFFFFFFF))
        assert tensor.data is not None
        update(_U64.pack(tensor.data.nbytes))
        update(tensor.data)
    update(_U32.pack(len(request.outputs)))  # 0: every output
    for output in request.outputs:
        _text(update, output.name)
    params = sorted((k, v) for k, v in request.parameters.items() if k not in SCHEDULING)
    update(_U32.pack(len(params)))
    for name, value in params:
        _text(update, name)
        _text(update, f"{type(value).__name__}:{value!r}")
    return digest.digest()


def _text(update: Callable[[bytes], None], text: str) -> None:
    data = text.encode()
    update(_U32.pack(len(data)))
    update(data)


class ModelCache:
    """One loaded model version's use of the server's cache, counted in its statistics."""

    def __init__(self, cache: ResponseCache, stats: ModelStats) -> None:
        self.cache = cache
        self.stats = stats
        self.owner = cache.open()
        stats.cache_enabled = True

    def close(self) -> None:
        self.cache.close(self.owner)

    async def outputs(
        self, request: InferRequest, received: int, run: Callable[[], Awaitable[Outputs]]
    ) -> Outputs:
        """The cached response to ``request``, or ``run()``'s, stored for the next one."""
        start = time.monotonic_ns()
        version = self.stats.version
        if sum(t.data.nbytes for t in request.inputs if t.data is not None) > HASH_ON_THREAD:
            key = await asyncio.to_thread(request_key, self.owner, version, request)
        else:
            key = request_key(self.owner, version, request)
        found = self.cache.get(key)
        looked = time.monotonic_ns()
        if found is not None:
            self.stats.record_cache_hit(looked - received, start - received, looked - start)
            return found.outputs()
        outputs = await run()
        inserting = time.monotonic_ns()
        await self._store(key, outputs)
        self.stats.record_cache_miss(looked - start, time.monotonic_ns() - inserting)
        return outputs

    async def _store(self, key: bytes, outputs: Outputs) -> None:
        """Store the response: on the loop (``ResponseCache.put``), or with over
        ``COPY_ON_LOOP_LIMIT`` bytes to copy, its entry made on a thread. Without memory for
        the copy the response is answered all the same, not stored."""
        to_copy = _to_copy(outputs)
        try:
            if to_copy <= COPY_ON_LOOP_LIMIT:
                self.cache.put(key, self.owner, outputs)
                return
            start = time.monotonic_ns()
            size = self.cache.admits(key, self.owner, outputs)
            if size is not None:
                entry = await asyncio.to_thread(_entry, outputs, self.owner, size)
                self.cache.insert(key, entry)
            self.cache.insert_ns += time.monotonic_ns() - start
        except MemoryError:
            log.warning("model '%s': no memory to cache a response of %d bytes",
                        self.stats.name, to_copy)  # fmt: skip


def model_cache(cache: ResponseCache | None, config: Any, stats: ModelStats) -> ModelCache | None:
    """A loading model version's use of the server's cache, if its config enables it."""
    if not config.response_cache.enable:
        return None
    if cache is None:  # as in Triton, the model loads and runs without one
        log.warning("model '%s' enables response_cache, but the server has no cache "
                    "(--cache-config local,size=BYTES): its responses are not cached",
                    config.name)  # fmt: skip
        return None
    return ModelCache(cache, stats)


class CacheCollector(Collector):
    """The server-wide metrics Triton's local cache publishes (gauges, as it does)."""

    def __init__(self, cache: ResponseCache) -> None:
        self._cache = cache

    def collect(self) -> Iterator[Metric]:
        c = self._cache
        for name, doc, value in (
            ("nv_cache_util", "Cache utilization [0.0 - 1.0]", c.used / c.capacity),
            ("nv_cache_num_entries", "Number of responses stored in response cache",
             len(c.entries)),
            ("nv_cache_num_hits", "Number of cache hits in response cache", c.hits),
            ("nv_cache_num_misses", "Number of cache misses in response cache", c.misses),
            ("nv_cache_num_lookups", "Number of cache lookups in response cache", c.lookups),
            ("nv_cache_num_evictions", "Number of cache evictions in response cache",
             c.evictions),
            ("nv_cache_lookup_duration",
             "Total cache lookup duration (hit and miss), in microseconds", c.lookup_ns // 1000),
            ("nv_cache_insertion_duration", "Total cache insertion duration, in microseconds",
             c.insert_ns // 1000),
        ):  # fmt: skip
            metric = Metric(name, doc, "gauge")
            metric.add_sample(name, {}, value)
            yield metric
