"""Translation of Triton's non-inference gRPC messages: metadata, statistics, the
repository extension, and the log and trace settings."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from tritonclient.grpc import service_pb2 as pb

from dlserve.errors import InvalidArgumentError, UnsupportedError
from dlserve.types import (
    ModelMetadata,
    ModelStatistics,
    ParamValue,
    RepositoryEntry,
    ServerMetadata,
)

_Duration: Final = pb.StatisticDuration
_TensorMetadata: Final = pb.ModelMetadataResponse.TensorMetadata


# -- metadata, statistics, repository --------------------------------------------------
def server_metadata_response(metadata: ServerMetadata) -> Any:
    return pb.ServerMetadataResponse(
        name=metadata.name, version=metadata.version, extensions=metadata.extensions
    )


def model_metadata_response(metadata: ModelMetadata) -> Any:
    return pb.ModelMetadataResponse(
        name=metadata.name, versions=metadata.versions, platform=metadata.platform,
        inputs=[_TensorMetadata(name=t.name, datatype=t.datatype, shape=t.shape)
                for t in metadata.inputs],
        outputs=[_TensorMetadata(name=t.name, datatype=t.datatype, shape=t.shape)
                 for t in metadata.outputs],
    )  # fmt: skip


def _duration(stat: Any) -> Any:
    return _Duration(count=stat.count, ns=stat.ns)


def _model_statistics(stats: ModelStatistics) -> Any:
    infer = stats.inference_stats
    return pb.ModelStatistics(
        name=stats.name, version=stats.version, last_inference=stats.last_inference_ms,
        inference_count=stats.inference_count, execution_count=stats.execution_count,
        inference_stats=pb.InferStatistics(
            success=_duration(infer.success), fail=_duration(infer.fail),
            queue=_duration(infer.queue), compute_input=_duration(infer.compute_input),
            compute_infer=_duration(infer.compute_infer),
            compute_output=_duration(infer.compute_output),
            cache_hit=_duration(infer.cache_hit), cache_miss=_duration(infer.cache_miss),
        ),
        batch_stats=[
            pb.InferBatchStatistics(
                batch_size=b.batch_size, compute_input=_duration(b.compute_input),
                compute_infer=_duration(b.compute_infer),
                compute_output=_duration(b.compute_output),
            )
            for b in stats.batch_stats
        ],
    )  # fmt: skip


def statistics_response(stats: Sequence[ModelStatistics]) -> Any:
    return pb.ModelStatisticsResponse(model_stats=[_model_statistics(s) for s in stats])


def repository_index_response(entries: Sequence[RepositoryEntry]) -> Any:
    return pb.RepositoryIndexResponse(models=[
        pb.RepositoryIndexResponse.ModelIndex(
            name=e.name, version=e.version, state=e.state.value if e.state else "",
            reason=e.reason,
        )
        for e in entries
    ])  # fmt: skip


# -- repository control and log settings -----------------------------------------------
def _no_repository_name(request: Any) -> None:
    if request.repository_name:
        raise UnsupportedError("'repository_name' specification is not supported")


def load_parameters(request: Any) -> tuple[str | None, dict[str, bytes]]:
    """A RepositoryModelLoadRequest's "config" override and ``file:<path>`` model files,
    checked as Triton checks them."""
    _no_repository_name(request)
    config: str | None = None
    files: dict[str, bytes] = {}
    for key, param in request.parameters.items():
        which = param.WhichOneof("parameter_choice")
        if key == "config":
            if which != "string_param":
                raise InvalidArgumentError(
                    "invalid value type for load parameter 'config', expected string_param."
                )
            config = param.string_param
        elif key.startswith("file:"):
            if which != "bytes_param":
                raise InvalidArgumentError(
                    f"invalid value type for load parameter '{key}', expected bytes_param."
                )
            files[key] = param.bytes_param
        else:
            raise InvalidArgumentError(f"unrecognized load parameter '{key}'.")
    return config, files


def check_unload_request(request: Any) -> None:
    _no_repository_name(request)
    param = request.parameters.get("unload_dependents")
    if param is not None and param.WhichOneof("parameter_choice") != "bool_param":
        raise InvalidArgumentError(
            "invalid value type for 'unload_dependents' parameter, expected bool_param."
        )


_LOG_SETTING_KINDS: Final = {
    "log_info": ("bool_param", "boolean"), "log_warning": ("bool_param", "boolean"),
    "log_error": ("bool_param", "boolean"), "log_verbose_level": ("uint32_param", "int32"),
    "log_format": ("string_param", "string"),
}  # fmt: skip


def log_settings_update(request: Any) -> dict[str, ParamValue]:
    """A LogSettingsRequest's updates as python values, checked as Triton checks them."""
    updates: dict[str, ParamValue] = {}
    for key, value in request.settings.items():
        if key == "log_file":
            raise UnsupportedError("log file location can not be updated through network protocol")
        if key not in _LOG_SETTING_KINDS:
            continue  # Triton reads only the settings it knows
        which = value.WhichOneof("parameter_choice")
        expected, noun = _LOG_SETTING_KINDS[key]
        if which != expected:
            raise InvalidArgumentError(f"expect {noun} for '{key}'")
        updates[key] = getattr(value, which)
    log_format = updates.get("log_format", "default")
    if log_format not in ("default", "ISO8601"):
        raise InvalidArgumentError(f"invalid argument for log_format, got: {log_format}")
    return updates


def log_settings_response(settings: Mapping[str, Any]) -> Any:
    response = pb.LogSettingsResponse()
    for key, value in settings.items():
        setting = response.settings[key]
        if isinstance(value, bool):
            setting.bool_param = value
        elif isinstance(value, int):
            setting.uint32_param = value
        else:
            setting.string_param = str(value)
    return response


def trace_settings_update(request: Any) -> dict[str, list[str]]:
    return {key: list(value.value) for key, value in request.settings.items()}


def trace_settings_response(settings: Mapping[str, Sequence[str]]) -> Any:
    response = pb.TraceSettingResponse()
    for key, values in settings.items():
        response.settings[key].value.extend(values)
    return response
