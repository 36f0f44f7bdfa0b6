"""Endpoint groups that only requests carrying a header may use (Triton's "Limit Endpoint
Access": ``--grpc-restricted-protocol`` and ``--http-restricted-api``).

One table of group names for both protocols (Triton's ``RESTRICTED_CATEGORY_NAMES``, in
its order), which gRPC method and which HTTP route belongs to which group, the options'
parsing with Triton's messages (``ParseRestrictedFeatureOption`` in
triton-inference-server/server ``src/command_line_parser.cc``), and the check itself.
The core never sees headers: this is the frontends' business. Where no group is
restricted the frontends pay one attribute check per request.

A refused gRPC call ends with UNAVAILABLE "This protocol is restricted, expecting header
'triton-grpc-protocol-<key>'"; a refused HTTP request gets 403 with
``{"error": "This API is restricted, expecting header '<key>'"}`` (Triton's
``grpc_server.cc`` and ``http_server.cc``). Header names are compared without regard to
case, values exactly; the first header of the name counts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final

GROUPS: Final = (
    "health", "metadata", "inference", "shared-memory", "model-config", "model-repository",
    "statistics", "trace", "logging",
)  # fmt: skip
GRPC_HEADER_PREFIX: Final = "triton-grpc-protocol-"  # Triton's kRestrictedProtocolHeaderTemplate

_TRITON: Final = "/inference.GRPCInferenceService/"
GRPC_METHOD_GROUPS: Final[Mapping[str, str]] = {
    "/grpc.health.v1.Health/Check": "health",  # as Triton: health covers gRPC's health check
    **{_TRITON + rpc: "health" for rpc in ("ServerLive", "ServerReady", "ModelReady")},
    **{_TRITON + rpc: "metadata" for rpc in ("ServerMetadata", "ModelMetadata")},
    **{_TRITON + rpc: "inference" for rpc in ("ModelInfer", "ModelStreamInfer")},
    **{
        f"{_TRITON}{memory}SharedMemory{what}": "shared-memory"
        for memory in ("System", "Cuda")
        for what in ("Status", "Register", "Unregister")
    },
    _TRITON + "ModelConfig": "model-config",
    **{
        _TRITON + rpc: "model-repository"
        for rpc in ("RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload")
    },
    _TRITON + "ModelStatistics": "statistics",
    _TRITON + "TraceSetting": "trace",
    _TRITON + "LogSettings": "logging",
}

_MODEL: Final = ("/v2/models/{model}", "/v2/models/{model}/versions/{version:version}")
HTTP_ROUTE_GROUPS: Final[Mapping[str, str]] = {  # route path (Starlette's template) -> group
    "/v2/health/live": "health",
    "/v2/health/ready": "health",
    **{model + "/ready": "health" for model in _MODEL},
    "/v2": "metadata",
    "/v2/openapi.json": "metadata",  # dlserve's own: it describes the API
    **{model: "metadata" for model in _MODEL},
    **{
        model + path: "inference"
        for model in _MODEL
        for path in ("/infer", "/generate", "/generate_stream")
    },
    **{
        f"/v2/{memory}sharedmemory{region}/{what}": "shared-memory"
        for memory in ("system", "cuda")
        for region in ("", "/region/{region}")
        for what in ("status", "register", "unregister")
    },
    **{model + "/config": "model-config" for model in _MODEL},
    "/v2/repository/index": "model-repository",
    "/v2/repository/models/{model}/load": "model-repository",
    "/v2/repository/models/{model}/unload": "model-repository",
    "/v2/models/stats": "statistics",
    **{model + "/stats": "statistics" for model in _MODEL},
    "/v2/trace/setting": "trace",
    "/v2/models/{model}/trace/setting": "trace",
    "/v2/logging": "logging",
}


class RestrictionOptionError(ValueError):
    """A bad option value; the message is Triton's."""


@dataclass(frozen=True, slots=True)
class Restriction:
    """The header (as the option names it) a group's requests must carry, and its value."""

    header: str
    value: str
    # as they arrive: HPACK-decoded text (latin-1) and raw bytes; names in lower case
    _name: str = field(init=False, repr=False, compare=False)
    _text: str = field(init=False, repr=False, compare=False)
    _raw_name: bytes = field(init=False, repr=False, compare=False)
    _raw: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        raw_name, raw = self.header.lower().encode(), self.value.encode()
        for attribute, value in (("_name", raw_name.decode("latin-1")), ("_raw_name", raw_name),
                                 ("_text", raw.decode("latin-1")), ("_raw", raw)):  # fmt: skip
            object.__setattr__(self, attribute, value)

    def allows(self, headers: Iterable[tuple[str, str]]) -> bool:
        """Whether ``headers`` (gRPC's, as HPACK decodes them: latin-1) carry the value;
        the first header of the name counts."""
        for name, value in headers:
            if name.lower() == self._name:
                return value == self._text
        return False

    def allows_raw(self, headers: Iterable[tuple[bytes, bytes]]) -> bool:
        """Whether ``headers`` (ASGI's: bytes) carry the value."""
        for name, value in headers:
            if name.lower() == self._raw_name:
                return value == self._raw
        return False

    @property
    def grpc_message(self) -> str:
        return f"This protocol is restricted, expecting header '{self.header}'"

    @property
    def http_message(self) -> str:
        return f"This API is restricted, expecting header '{self.header}'"


Restrictions = dict[str, Restriction]  # group -> what its requests must carry


def add_option(
    restrictions: Restrictions, arg: str, option: str, kind: str, prefix: str = ""
) -> None:
    """Add one ``<group>[,<group>...]:<key>=<value>`` option to ``restrictions``.

    ``option`` is the option's name (for the message), ``kind`` "protocol" or "api",
    ``prefix`` what goes before the key to make the header (gRPC's
    ``triton-grpc-protocol-``). A group already restricted, by this option or another,
    is refused, as Triton does.
    """
    groups, key, value = _split(arg, option)
    for group in groups.split(","):
        if group not in GROUPS:
            raise RestrictionOptionError(f"unknown restricted {kind} '{group}'")
        if group in restrictions:
            raise RestrictionOptionError(
                f"restricted {kind} '{group}' can not be specified in multiple config groups"
            )
        restrictions[group] = Restriction(prefix + key, value)


def _split(arg: str, option: str) -> tuple[str, str, str]:
    """``<groups>:<key>=<value>``, each part non-empty (the key ends at the first '=')."""
    colon = arg.find(":")
    equals = arg.find("=", colon + 1) if colon >= 0 else -1
    parts = (arg[:colon], arg[colon + 1 : equals], arg[equals + 1 :])
    if equals < 0 or not all(parts):
        raise RestrictionOptionError(
            f"--{option} option format is '<config name>:<setting>=<value>'. Got {arg}"
        )
    return parts


def parse_options(args: Iterable[str], option: str, kind: str, prefix: str = "") -> Restrictions:
    """All the occurrences of one option (a group in two of them is refused)."""
    restrictions: Restrictions = {}
    for arg in args:
        add_option(restrictions, arg, option, kind, prefix)
    return restrictions


def group_of(table: Mapping[str, str], key: str) -> str:
    """The group of a gRPC method or HTTP route; every one must have one."""
    group = table.get(key)
    if group is None:
        raise LookupError(f"'{key}' belongs to no restricted endpoint group")
    return group
