"""Core request/response types shared by the frontends and the core.

They carry tensor bytes as buffers (``memoryview``), never JSON lists: the HTTP
frontend converts JSON data into bytes before a request reaches the core. A tensor
in a client's shared-memory region carries a :class:`RegionRef` instead of bytes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

ParamValue = bool | int | float | str
Parameters = dict[str, ParamValue]


@dataclass(frozen=True, slots=True)
class RegionRef:
    """A tensor's place in a client's system shared-memory region, as a request names it:
    ``byte_size`` bytes from ``offset`` (counted from the start of the registered region)."""

    region: str
    byte_size: int
    offset: int = 0


@dataclass(frozen=True, slots=True)
class RegionSpan:
    """A :class:`RegionRef` the core has checked: where the bytes are in the client's memory.

    System shared memory: ``key`` names the object and ``offset`` counts from its start.
    CUDA shared memory: ``handle`` is the allocation's CUDA IPC handle, ``device`` its GPU,
    and ``offset`` counts from the allocation's start.
    """

    region_id: int  # unique for the server's lifetime: workers cache their mappings by it
    key: str  # the shared-memory object's name (shm_open's); "" for CUDA
    offset: int
    byte_size: int
    handle: bytes = b""  # CUDA: the cudaIpcMemHandle_t's 64 bytes
    device: int = -1  # CUDA: the GPU the memory is on; -1 for system shared memory

    @property
    def is_cuda(self) -> bool:
        return self.device >= 0


@dataclass(frozen=True, slots=True)
class ArenaSpan:
    """Bytes in a worker's shared-memory arena, handed to another worker by reference (BLS).

    ``path`` reopens the arena (a /proc path of the server's memfd); workers map each
    arena once, by ``arena_id``.
    """

    arena_id: int
    path: str
    offset: int
    byte_size: int


@dataclass(frozen=True, slots=True)
class CudaSpan:
    """GPU memory of a worker, handed to another by CUDA IPC handle (BLS): the allocation's
    handle and device, and the tensor's place in it. ``lend_id``: an output the owner keeps
    until the borrower gives it back (0 for a caller's input, alive until the reply)."""

    handle: bytes
    device: int
    offset: int
    byte_size: int
    lend_id: int = 0
    owner: int = 0  # the lending worker's output arena id (gives it back through it)


@dataclass(frozen=True, slots=True)
class RegionStatus:
    """A registered region, as the status calls list it (``key``/``offset``: system
    shared memory; ``device_id``: CUDA shared memory)."""

    name: str
    key: str
    offset: int
    byte_size: int
    device_id: int = -1


@dataclass(frozen=True, slots=True)
class Peer:
    """Where a request came from: an IP address, or None for a Unix socket connection.

    An address that is not an IP address (say "") stands for a peer the frontend could not
    tell: the core treats it as remote. ``port`` is the peer's TCP port where known;
    ``pid`` the process id a client says it has (the ``dlserve-client-pid`` header), which
    the core believes only where the operating system confirms it (``server/core/shm/owners.py``);
    ``connection_pid`` the process at the other end of the request's own connection, as the
    operating system says (SO_PEERCRED on a Unix socket), where the frontend knows it.
    """

    address: str | None
    port: int | None = None
    pid: int | None = None
    connection_pid: int | None = None


@dataclass(slots=True)
class InputTensor:
    """One request input. ``data`` holds the raw little-endian C-order bytes
    (BYTES serialized as Triton does), or is None when ``region`` says where they are."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: memoryview | None
    parameters: Parameters = field(default_factory=dict)
    region: RegionRef | None = None


@dataclass(slots=True)
class RequestedOutput:
    """An output the client asks for; ``region``: write it there instead of the response."""

    name: str
    parameters: Parameters = field(default_factory=dict)
    region: RegionRef | None = None


@dataclass(slots=True)
class InferRequest:
    model_name: str
    model_version: str  # "" means the model's default version policy
    id: str
    inputs: list[InputTensor]
    outputs: list[RequestedOutput]  # empty: every output of the model
    parameters: Parameters = field(default_factory=dict)
    peer: Peer | None = None  # who sent it (None: unknown); checked when it names a region


@dataclass(slots=True)
class OutputTensor:
    """One response output; ``data`` is None when it was written into a region, or when
    it stays in the model's output arena for a BLS caller to map (``lent``)."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: bytes | memoryview | None
    parameters: Parameters = field(default_factory=dict)
    lent: ArenaSpan | CudaSpan | None = None


@dataclass(slots=True)
class InferResponse:
    model_name: str
    model_version: str
    id: str
    outputs: list[OutputTensor]
    parameters: Parameters = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class TensorMetadata:
    name: str
    datatype: str
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ModelMetadata:
    name: str
    versions: tuple[str, ...]
    platform: str
    inputs: tuple[TensorMetadata, ...]
    outputs: tuple[TensorMetadata, ...]


@dataclass(frozen=True, slots=True)
class ServerMetadata:
    name: str
    version: str
    extensions: tuple[str, ...]


class ModelState(enum.Enum):
    """A model version's state, named as Triton's repository index names it."""

    LOADING = "LOADING"
    READY = "READY"
    UNLOADING = "UNLOADING"
    UNAVAILABLE = "UNAVAILABLE"


@dataclass(frozen=True, slots=True)
class RepositoryEntry:
    name: str
    version: str
    state: ModelState | None  # None: present in the repository, never loaded
    reason: str


@dataclass(frozen=True, slots=True)
class DurationStat:
    count: int = 0
    ns: int = 0


@dataclass(frozen=True, slots=True)
class InferenceStats:
    success: DurationStat = DurationStat()
    fail: DurationStat = DurationStat()
    queue: DurationStat = DurationStat()
    compute_input: DurationStat = DurationStat()
    compute_infer: DurationStat = DurationStat()
    compute_output: DurationStat = DurationStat()
    cache_hit: DurationStat = DurationStat()
    cache_miss: DurationStat = DurationStat()


@dataclass(frozen=True, slots=True)
class BatchStats:
    batch_size: int
    compute_input: DurationStat
    compute_infer: DurationStat
    compute_output: DurationStat


@dataclass(frozen=True, slots=True)
class ModelStatistics:
    name: str
    version: str
    last_inference_ms: int
    inference_count: int
    execution_count: int
    inference_stats: InferenceStats
    batch_stats: tuple[BatchStats, ...]
