"""Messages of BLS calls that go from one worker straight to another
(``worker/bls/direct_caller.py``).

A caller asks the server once per callee model (:class:`DirectOpen`). The server answers
with what the caller needs to call that model's instances itself (:class:`DirectTargets`:
the callee's tensors for validation, its instances) and hands each instance one end of a
new socketpair (:class:`DirectAccept`) and the caller the other ends; the descriptors
travel beside the frame, on the worker's descriptor socket. From then on a call is an
``Infer`` frame from the caller to the callee and an ``InferDone`` back, over that socket;
``Release`` frames give lent outputs back the same way. The callee's timings come back in
its ``InferDone``; the caller forwards them to the server as records in its own reply's
``InferDone`` (or a :class:`DirectStats` frame ahead of a reply of another kind). The
server counts them right after it has handled that reply, before it reads anything else,
so the callee's statistics count every call by the time the caller's client can ask.
"""

from __future__ import annotations

import msgspec

from dlserve.ipc.structs import Timings, _Msg


class DirectSpec(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One input or output of the callee's config, as the server's validator sees it."""

    name: str
    datatype: str  # the wire name (FP32, BYTES ...)
    dims: list[int]  # without the batch dimension; -1: any size
    optional: bool = False


class DirectInstance(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One instance of the callee (a socket descriptor travels for each, in order)."""

    name: str
    device: int = -1  # its GPU; -1 for a CPU instance


class DirectOpen(_Msg, tag=113):
    """A caller asks to call ``model_name`` directly (answered by DirectTargets)."""

    call: int
    model_name: str
    model_version: int = -1  # -1: the newest ready version


class DirectTargets(_Msg, tag=13):
    """The answer to DirectOpen. ``target`` 0 with ``error``: not directly callable (the
    call goes through the server; asked again next time unless ``lasting``: the model's
    config says so, until it changes); otherwise the server's id of the callee's version
    (DirectStats names it), and one socket descriptor per instance."""

    call: int
    target: int = 0
    error: str = ""
    lasting: bool = False
    model_version: int = 0
    max_batch_size: int = 0
    inputs: list[DirectSpec] = []
    outputs: list[DirectSpec] = []
    instances: list[DirectInstance] = []
    arena_ids: list[int] = []  # the caller's own (input, output) arenas, for PEER_ARENA refs
    arena_paths: list[str] = []


class DirectAccept(_Msg, tag=14):
    """A caller's connection to this instance (its descriptor travels beside the frame);
    the instance's own arenas, so that outputs it lends are PEER_ARENA refs."""

    arena_ids: list[int]
    arena_paths: list[str]


class DirectStale(_Msg, tag=15):
    """``model_name`` was loaded, reloaded or unloaded: what the caller knows of it (its
    targets, a refusal) is out of date and asked for again at the next call."""

    model_name: str


class DirectRecord(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One direct call, for the callee's statistics (CLOCK_MONOTONIC nanoseconds)."""

    target: int
    sent_ns: int  # when the caller sent it
    done_ns: int  # when the caller had the answer
    batch: int = 1
    timings: Timings | None = None  # None: it failed, with ``error_code``
    error_code: str = ""
    rejected: bool = False  # failed the callee's checks (Triton's REJECTED), not run


class DirectStats(_Msg, tag=114):
    records: list[DirectRecord]


class DirectMapped(_Msg, tag=115):
    """This worker mapped these client regions for direct calls: tell it when they go."""

    regions: list[int]


class DirectBye(_Msg, tag=116):
    """The callee closes the connection (its model is stopping): the calls it has not
    answered were not run, and go through the server instead."""
