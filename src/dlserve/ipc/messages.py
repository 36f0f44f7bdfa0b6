"""The closed set of messages between the server and a worker process.

Each message is a msgspec Struct in a tagged union; one decoder per direction.
Tensor bytes never travel inside a message: a :class:`TensorRef` says where
they are (the frame's payload, a shared-memory arena, a client's region).
"""

from __future__ import annotations

import msgspec

from dlserve.ipc.direct_messages import (
    DirectAccept,
    DirectBye,
    DirectInstance,
    DirectMapped,
    DirectOpen,
    DirectRecord,
    DirectSpec,
    DirectStale,
    DirectStats,
    DirectTargets,
)
from dlserve.ipc.structs import Fence, ParamValue, TensorRef, Timings, Where, _Msg

__all__ = [
    "DirectAccept",
    "DirectBye",
    "DirectInstance",
    "DirectMapped",
    "DirectOpen",
    "DirectRecord",
    "DirectSpec",
    "DirectStale",
    "DirectStats",
    "DirectTargets",
    "Fence",
    "ParamValue",
    "TensorRef",
    "Timings",
    "Where",
    "_Msg",
]  # re-exported: every message is imported from here


def chain_entry(model_name: str, model_version: int, instance_name: str) -> str:
    """An instance in a BLS call chain (``Infer.chain``): the model, its version and the
    instance. A model's name has no '/', so :func:`chain_model` reads it back."""
    return f"{model_name}/{model_version}/{instance_name}"


def chain_model(entry: str) -> str:
    """The model of a :func:`chain_entry`."""
    return entry.split("/", 1)[0]


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


class Request(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, kw_only=True):
    """A request's own fields, declared once for every message that carries one (an
    :class:`Infer`, a :class:`BatchItem`, a :class:`BlsCall`). Keyword-only, as are the
    fields the messages add: on the wire (array-like) these come first."""

    request_id: str = ""
    inputs: list[TensorRef]
    outputs: list[str] = []  # requested output names; empty: all the model produces
    parameters: dict[str, ParamValue] = {}
    chain: list[str] = []  # BLS: the instances upstream of it (chain_entry), callers first
    correlation_id: int | str = 0  # the sequence id (0: none), as pb_utils returns it
    flags: int = 0  # Triton's request flags: SEQUENCE_START 1, SEQUENCE_END 2
    trace_id: int = 0  # the request's trace id (0: not traced), for request.trace()
    timeout_us: int = 0  # the request's timeout (microseconds, 0: none): request.timeout()


class BatchItem(Request, kw_only=True):
    """One request as a worker receives it: alone (:class:`Infer`) or in an
    :class:`InferBatch`."""

    rid: int
    # outputs to write into client regions: CLIENT_REGION refs, nbytes the room there
    output_regions: list[TensorRef] = []
    lend: bool = False  # BLS: GPU outputs go by IPC handle, kept until given back


class Infer(BatchItem, _Msg, tag=2, kw_only=True):
    """One request for one ``execute`` call, with what its frame carries besides."""

    release: list[int] = []  # output-arena offsets the server is done with
    # direct BLS calls: the caller's GPU work on its inputs, to wait for before they are
    # read; ``fenced``: the reply may carry the callee's own fences instead of its waits
    fences: list[Fence] = []
    fenced: bool = False


class Cancel(_Msg, tag=7):
    """The client of request ``rid`` went away: ``is_cancelled()`` becomes true for it."""

    rid: int


class BlsReply(_Msg, tag=8):
    """One response to a BLS call (a decoupled callee may send several; the last is final).

    ``has_response`` is False for a final flag that carries no response.
    """

    call: int
    outputs: list[TensorRef] = []
    error: str = ""
    error_code: str = ""
    final: bool = True
    has_response: bool = True
    parameters: dict[str, ParamValue] = {}


class Credit(_Msg, tag=12):
    """Flow control of decoupled request ``rid``: its consumer has taken ``responses`` more
    of its responses (``nbytes`` of their bytes, as :func:`stream_bytes` counts them), so
    the model may send that many more (see :data:`WINDOW_RESPONSES`)."""

    rid: int
    responses: int
    nbytes: int = 0


class ControlReply(_Msg, tag=9):
    """The answer to a ControlCall: ``ready`` for "ready", else only an error or nothing."""

    call: int
    ready: bool = False
    error: str = ""
    error_code: str = ""


class Release(_Msg, tag=3):
    offsets: list[int]
    gpu: list[int] = []  # lent GPU outputs (their lend ids) a BLS caller is done with


class Shutdown(_Msg, tag=4):
    pass


class MetricValueReply(_Msg, tag=5):
    call: int
    value: float
    error: str = ""  # the call could not be answered (its frame could not be read)


class UnmapRegions(_Msg, tag=6):
    """These client regions are gone: drop their mappings (no request uses them now)."""

    regions: list[int]


class LogSettings(_Msg, tag=11):
    """The server's log settings changed: which of the model's log lines print."""

    verbose: int = 0
    info: bool = True
    warning: bool = True
    error: bool = True
    iso8601: bool = False  # log_format "ISO8601": the lines' timestamps


class DropArenas(_Msg, tag=10):
    """These workers' arenas are gone (the worker stopped): drop their mappings."""

    arenas: list[int]


class InferBatch(_Msg, tag=20):
    """Several requests for one ``execute(requests)`` call (dynamic batching).

    The PAYLOAD offsets of every item's inputs count from the start of this frame's
    payload. The worker answers with one :class:`InferDone` per item, each in its own frame.
    """

    items: list[BatchItem]
    release: list[int] = []


ServerToWorker = (
    Load
    | Infer
    | Release
    | Shutdown
    | MetricValueReply
    | UnmapRegions
    | Cancel
    | BlsReply
    | ControlReply
    | DropArenas
    | InferBatch
    | LogSettings
    | Credit
    | DirectTargets
    | DirectAccept
    | DirectStale
)

# ---- worker -> server -----------------------------------------------------------------


class Loaded(_Msg, tag=101):
    config_json: str  # the config after auto-complete
    pid: int


class LoadFailed(_Msg, tag=102):
    message: str


class InferDone(_Msg, tag=103):
    rid: int
    outputs: list[TensorRef] = []
    error: str = ""
    error_code: str = ""  # an ErrorCode value; "" when there is no error
    timings: Timings | None = None
    parameters: dict[str, ParamValue] = {}
    # the model rescheduled the request (iterative sequences): no response yet, run it again
    rescheduled: bool = False
    # direct BLS calls this worker finished before this reply, for the callees' statistics
    # (they ride here rather than in a DirectStats frame of their own: one frame to read,
    # and counted by the time this reply's response can be seen)
    direct: list[DirectRecord] = []
    # GPU work of the model's not waited for (its request was ``fenced``): the caller
    # orders its own work on the lent outputs and its inputs after these
    fences: list[Fence] = []
    # no response yet: the request's execute() returned (the instance is free) and the
    # model holds its response sender; the response comes in a later InferDone (a model
    # that is not decoupled may answer after execute returns)
    deferred: bool = False


class StreamResponse(_Msg, tag=104):
    """One response of a decoupled model's request; ``final`` ends the request.

    ``has_response`` is False for a bare final flag (``send(flags=FINAL)``), and for the
    ``executed`` notice.
    """

    rid: int
    outputs: list[TensorRef] = []
    error: str = ""
    error_code: str = ""
    final: bool = False
    has_response: bool = True
    timings: Timings | None = None  # with the final flag, and with the executed notice
    parameters: dict[str, ParamValue] = {}
    # no response: the request's execute() has returned, so the instance is free for the
    # next one (responses sent from the model's threads may still follow)
    executed: bool = False
    rescheduled: bool = False  # with ``executed``: the model asked to run it again


# Flow control of a decoupled request's responses: a sender may have this many responses
# (or this many bytes of them, one response beyond) not yet taken by the consumer; the
# consumer gives credit back in batches of half of it (one Credit frame per 32 responses or
# 4 MiB when it keeps up). The final response is never held back. 64 rather than 16: a
# model that sends small responses faster than the client reads them waits for credit,
# and with 16 the wake-ups took a large share of a stream of small responses' time (the
# performance page, Measurements behind design decisions).
WINDOW_RESPONSES = 64
WINDOW_BYTES = 8 * 1024 * 1024


def stream_bytes(outputs: list[TensorRef]) -> int:
    """The bytes of a response that flow control counts: those the frame or the output
    arena carries (outputs written into a client's region cost the server nothing)."""
    return sum(r.nbytes for r in outputs if r.where in (Where.PAYLOAD, Where.OUTPUT_ARENA))


class BlsCredit(_Msg, tag=108):
    """A decoupled BLS call's caller about its responses. ``stop``: it stopped listening
    (``cancel()``, or its iterator was collected): the rest is dropped and the callee sees
    ``is_cancelled()``. (Responses are not held back by what the caller has taken:
    server/core/calls/bls_router.py says why.)"""

    call: int
    stop: bool = False


class BlsCall(Request, _Msg, tag=105, kw_only=True):
    """A model's request to another model (``InferenceRequest.exec``).

    Inputs are PAYLOAD refs (bytes in this frame), CLIENT_REGION refs (a client's region
    the caller received its input in), INPUT_ARENA refs (the caller's own input) or
    OUTPUT_ARENA refs (copied once into the caller's output arena, freed by the caller
    when the call is over): the server hands the callee a reference, not the bytes.
    ``chain`` ends with the caller; ``trace_id`` is the caller's trace
    (``trace=request.trace()``); ``timeout_us`` 0 is none.
    """

    call: int
    model_name: str
    model_version: int = -1
    decoupled: bool = False  # the caller iterates over the responses


class ControlCall(_Msg, tag=106):
    """``pb_utils.is_model_ready`` / ``load_model`` / ``unload_model``."""

    call: int
    op: str  # "ready" / "load" / "unload"
    model_name: str
    model_version: str = ""
    config: str = ""
    unload_dependents: bool = False
    files: dict[str, bytes] = {}  # load: the model's files ("file:<path>" -> content)


class PeerRelease(_Msg, tag=107):
    """A BLS caller is done with outputs it mapped from callees' arenas (PEER_ARENA refs):
    ``offsets[i]`` of arena ``arenas[i]`` may be reused."""

    arenas: list[int]
    offsets: list[int]


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
    Loaded
    | LoadFailed
    | InferDone
    | MetricFamilyDef
    | MetricOp
    | MetricValueCall
    | Closed
    | StreamResponse
    | BlsCall
    | ControlCall
    | PeerRelease
    | BlsCredit
    | DirectOpen
    | DirectStats
    | DirectMapped
    | DirectBye
)
