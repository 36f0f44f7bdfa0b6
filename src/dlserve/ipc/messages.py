"""The closed set of messages between the server and a worker process.

Each message is a msgspec Struct in a tagged union; one decoder per direction.
Tensor bytes never travel inside a message: a :class:`TensorRef` says where
they are (the frame's payload, a shared-memory arena, a client's region).
"""

from __future__ import annotations

import enum

import msgspec

ParamValue = bool | int | float | str


class Where(enum.IntEnum):
    """Where a tensor's bytes live."""

    PAYLOAD = 0  # in this frame's payload, at offset
    INPUT_ARENA = 1  # the server-owned input arena of this worker
    OUTPUT_ARENA = 2  # the worker-owned output arena
    NOWHERE = 3  # no data (output written into a client region elsewhere)
    CLIENT_REGION = 4  # a client's shared-memory object (key), at offset from its start
    CUDA_REGION = 5  # a client's GPU allocation (handle, device), at offset from its start


class TensorRef(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    name: str
    datatype: str
    shape: list[int]
    where: Where
    offset: int
    nbytes: int
    region: int = 0  # CLIENT_REGION: the region's id (workers map each region once, by id)
    key: str = ""  # CLIENT_REGION: the shared-memory object's name
    handle: bytes = b""  # CUDA_REGION: the allocation's cudaIpcMemHandle_t
    device: int = 0  # CUDA_REGION: the GPU the allocation is on


class _Msg(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


# ---- server -> worker -----------------------------------------------------------------


class Load(_Msg, tag=1):
    """Import model.py, optionally auto-complete the config, then initialize."""

    model_name: str
    model_version: int
    repository: str  # the model repository root
    model_path: str  # the model's directory
    model_file: str  # absolute path of model.py
    config_json: str
    instance_name: str
    instance_kind: str  # "CPU" / "GPU" / "MODEL"
    device_id: int
    autocomplete: bool = False
    initialize: bool = True


class Infer(_Msg, tag=2):
    rid: int
    request_id: str
    inputs: list[TensorRef]
    outputs: list[str]  # requested output names; empty: all the model produces
    parameters: dict[str, ParamValue] = {}
    release: list[int] = []  # output-arena offsets the server is done with
    # outputs to write into client regions: CLIENT_REGION refs, nbytes the room there
    output_regions: list[TensorRef] = []


class Release(_Msg, tag=3):
    offsets: list[int]


class Shutdown(_Msg, tag=4):
    pass


class MetricValueReply(_Msg, tag=5):
    call: int
    value: float


class UnmapRegions(_Msg, tag=6):
    """These client regions are gone: drop their mappings (no request uses them now)."""

    regions: list[int]


ServerToWorker = Load | Infer | Release | Shutdown | MetricValueReply | UnmapRegions

# ---- worker -> server -----------------------------------------------------------------


class Loaded(_Msg, tag=101):
    config_json: str  # the config after auto-complete
    pid: int


class LoadFailed(_Msg, tag=102):
    message: str


class Timings(msgspec.Struct, array_like=True, gc=False):
    """CLOCK_MONOTONIC nanoseconds, comparable across processes on one host."""

    input_start: int
    infer_start: int
    infer_end: int
    output_end: int


class InferDone(_Msg, tag=103):
    rid: int
    outputs: list[TensorRef] = []
    error: str = ""
    error_code: str = ""  # an ErrorCode value; "" when there is no error
    timings: Timings | None = None
    parameters: dict[str, ParamValue] = {}


class MetricFamilyDef(_Msg, tag=110):
    name: str
    description: str
    kind: str  # "counter" / "gauge" / "histogram"
    buckets: list[float] = []


class MetricOp(_Msg, tag=111):
    family: str
    labels: dict[str, str]
    op: str  # "inc" / "set" / "observe" / "create" / "delete"
    value: float = 0.0
    buckets: list[float] = []  # "create" of a histogram: its bucket bounds


class MetricValueCall(_Msg, tag=112):
    call: int
    family: str
    labels: dict[str, str]


class Closed(_Msg, tag=120):
    """The worker finalized its model and is about to exit."""


WorkerToServer = (
    Loaded | LoadFailed | InferDone | MetricFamilyDef | MetricOp | MetricValueCall | Closed
)
