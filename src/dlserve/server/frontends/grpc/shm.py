"""gRPC translation for system and CUDA shared memory: region parameters, status, the peer.

A tensor names a region with three parameters, typed as Triton types them
(``src/grpc/grpc_utils.h``): ``shared_memory_region`` a string_param,
``shared_memory_offset`` and ``shared_memory_byte_size`` int64_params.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any, Final
from urllib.parse import unquote

from tritonclient.grpc import service_pb2 as pb

from dlserve.errors import InvalidArgumentError
from dlserve.types import Parameters, ParamValue, Peer, RegionRef, RegionStatus

CLIENT_PID_HEADER: Final = "dlserve-client-pid"
REGION_KEYS: Final = ("shared_memory_region", "shared_memory_offset", "shared_memory_byte_size")
_RegionStatusMessage: Final = pb.SystemSharedMemoryStatusResponse.RegionStatus
_CudaRegionStatusMessage: Final = pb.CudaSharedMemoryStatusResponse.RegionStatus


def tensor_params(tensor: Any) -> tuple[Parameters, RegionRef | None]:
    """An input's or requested output's parameters as python values, less the ones that
    name its region, and that region (None when it names none); one pass over the map."""
    params: Parameters = {}
    named: dict[str, Any] | None = None
    for key, param in tensor.parameters.items():
        if key in REGION_KEYS:
            if named is None:
                named = {}
            named[key] = param
        else:
            params[key] = param
    region = None if named is None else _region(tensor.name, named)
    return {key: param_value(key, param) for key, param in params.items()}, region


def param_value(key: str, param: Any) -> ParamValue:
    """One InferParameter as a python value."""
    which = param.WhichOneof("parameter_choice")
    if which is None:
        raise InvalidArgumentError(
            f"invalid value type for '{key}' parameter, expected int64_param, bool_param, "
            "double_param, uint64_param or string_param."
        )
    value: ParamValue = getattr(param, which)
    return value


def _region(name: str, params: dict[str, Any]) -> RegionRef | None:
    """The region the region keys among a tensor's parameters name, checked as Triton does."""
    region: str | None = None
    if "shared_memory_region" in params:
        param = params["shared_memory_region"]
        if param.WhichOneof("parameter_choice") != "string_param":
            raise InvalidArgumentError(
                "invalid value type for 'shared_memory_region' parameter for tensor "
                f"'{name}', expected string_param."
            )
        region = param.string_param
    offset = _int64_param(params, "shared_memory_offset", name, region)
    byte_size = _int64_param(params, "shared_memory_byte_size", name, region)
    if region is None:
        return None
    if byte_size is None:
        raise InvalidArgumentError(
            "'shared_memory_byte_size' must be specified along with 'shared_memory_region' "
            f"parameter for tensor '{name}'"
        )
    return RegionRef(region, byte_size, offset or 0)


def _int64_param(params: dict[str, Any], key: str, tensor: str, region: str | None) -> int | None:
    if key not in params:
        return None
    if region is None:
        raise InvalidArgumentError(
            f"'{key}' can not be specified without 'shared_memory_region' parameter for "
            f"tensor '{tensor}'"
        )
    param = params[key]
    if param.WhichOneof("parameter_choice") != "int64_param":
        raise InvalidArgumentError(
            f"invalid value type for '{key}' parameter for tensor '{tensor}', expected int64_param."
        )
    value: int = param.int64_param
    return value


def status_response(regions: Sequence[RegionStatus]) -> Any:
    return pb.SystemSharedMemoryStatusResponse(
        regions={
            r.name: _RegionStatusMessage(
                name=r.name, key=r.key, offset=r.offset, byte_size=r.byte_size
            )
            for r in regions
        }
    )


def cuda_status_response(regions: Sequence[RegionStatus]) -> Any:
    return pb.CudaSharedMemoryStatusResponse(
        regions={
            r.name: _CudaRegionStatusMessage(
                name=r.name, device_id=r.device_id, byte_size=r.byte_size
            )
            for r in regions
        }
    )


@functools.lru_cache(maxsize=4096)  # asked per request; a connection's answer never changes
def peer_of(text: str | None, pid: int | None = None, connection_pid: int | None = None) -> Peer:
    """gRPC's peer string ("ipv4:127.0.0.1:5000", "ipv6:[::1]:5000", "unix:/path") as a Peer;
    ``pid``: the one the client claims (:func:`claimed_pid`); ``connection_pid``: the
    process the operating system names for the call's Unix-socket connection.

    Anything else is a peer that cannot be told: Peer(""), which counts as remote.
    """
    kind, _, rest = (text or "").partition(":")
    if kind in ("unix", "unix-abstract"):
        return Peer(None, pid=pid, connection_pid=connection_pid)
    if kind == "ipv4":
        host, _, port = rest.rpartition(":")
        return Peer(host, _port(port), pid)
    if kind == "ipv6":
        host, _, port = unquote(rest).rpartition(":")
        return Peer(host.removeprefix("[").removesuffix("]"), _port(port), pid)
    return Peer("")


def _port(text: str) -> int | None:
    return int(text) if text.isdigit() else None


def claimed_pid(metadata: Iterable[tuple[str, str | bytes]] | None) -> int | None:
    """The process id a client says it has (``dlserve-client-pid``), believed only where the
    core can confirm it."""
    for key, value in metadata or ():
        if key == CLIENT_PID_HEADER:
            text = value.decode() if isinstance(value, bytes) else value
            return int(text) if text.isdigit() else None
    return None
