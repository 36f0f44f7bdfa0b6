"""Model configuration: ``config.pbtxt`` parsed into Triton's own ``ModelConfig``.

Parsing uses protobuf's text_format on the ``model_config_pb2`` that ships in
tritonclient; normalization fills what Triton fills (name, backend defaults,
instance groups, version policy).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from google.protobuf import descriptor, json_format, text_format
from tritonclient.grpc import model_config_pb2 as mc

from dlserve.errors import InvalidArgumentError

ModelConfig = mc.ModelConfig
_INT64_TYPES = {
    descriptor.FieldDescriptor.TYPE_INT64,
    descriptor.FieldDescriptor.TYPE_UINT64,
    descriptor.FieldDescriptor.TYPE_SINT64,
    descriptor.FieldDescriptor.TYPE_FIXED64,
    descriptor.FieldDescriptor.TYPE_SFIXED64,
}


class ConfigError(InvalidArgumentError):
    """config.pbtxt is missing, unreadable or invalid."""


def parse_config_text(text: str, source: str) -> Any:
    config = ModelConfig()
    try:
        text_format.Parse(text, config)
    except text_format.ParseError as exc:
        raise ConfigError(f"failed to parse {source}: {exc}") from None
    return config


def read_config(model_dir: Path, config_name: str = "") -> Any:
    """The model's config: ``configs/<config_name>.pbtxt`` when a name is given and the model
    has that file (Triton's ``--model-config-name``), else ``config.pbtxt``; a directory
    without either gets an empty one (auto-complete)."""
    path = model_dir / "config.pbtxt"
    if config_name and (custom := model_dir / "configs" / f"{config_name}.pbtxt").exists():
        path = custom
    if not path.exists():
        return ModelConfig()
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    return parse_config_text(text, str(path))


def config_from_json(text: str, source: str) -> Any:
    config = ModelConfig()
    try:
        json_format.Parse(text, config)
    except json_format.ParseError as exc:
        raise ConfigError(f"invalid model configuration from {source}: {exc}") from None
    return config


def config_to_dict(config: Any) -> dict[str, Any]:
    """Triton's JSON form of a config: proto field names, defaults printed, int64 as numbers."""
    result: dict[str, Any] = json_format.MessageToDict(
        config, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    _int64_to_numbers(result, config.DESCRIPTOR)
    return result


def config_to_json(config: Any) -> str:
    return json.dumps(config_to_dict(config))


def _int64_to_numbers(data: dict[str, Any], desc: Any) -> None:
    for field in desc.fields:
        if field.name not in data:
            continue
        value = data[field.name]
        message_type = field.message_type
        if message_type is not None and message_type.GetOptions().map_entry:
            _convert_map(value, message_type.fields_by_name["value"])
        elif message_type is not None:
            for item in value if isinstance(value, list) else [value]:
                _int64_to_numbers(item, message_type)
        elif field.type in _INT64_TYPES:
            data[field.name] = [int(v) for v in value] if isinstance(value, list) else int(value)


def _convert_map(mapping: dict[str, Any], value_field: Any) -> None:
    for key, item in mapping.items():
        if value_field.message_type is not None:
            _int64_to_numbers(item, value_field.message_type)
        elif value_field.type in _INT64_TYPES:
            mapping[key] = int(item)


def normalize(config: Any, name: str, gpu_count: int) -> None:
    """Fill in what Triton fills in; raises ConfigError for what it would refuse."""
    if config.name and config.name != name:
        raise ConfigError(
            f"model name '{config.name}' in config.pbtxt does not match its directory '{name}'"
        )
    config.name = name
    if config.platform == "ensemble":
        _normalize_ensemble(config, name)
        return
    if not config.backend:
        config.backend = "python"
    if config.backend != "python":
        raise ConfigError(
            f"model '{name}' asks for backend '{config.backend}'; dlserve runs Python-backend "
            'models only (backend: "python")'
        )
    if config.max_batch_size < 0:
        raise ConfigError(f"model '{name}': max_batch_size must be >= 0")
    _check_tensors(config, name)
    _refuse_unsupported(config, name)
    _check_response_cache(config, name)
    if config.HasField("sequence_batching"):
        from dlserve.server.core.scheduling import sequence_config

        sequence_config.check(config, name)
    _normalize_instance_groups(config, name, gpu_count)
    if not config.HasField("version_policy"):
        config.version_policy.latest.num_versions = 1


def _refuse_unsupported(config: Any, name: str) -> None:
    """What would change what the model receives, and dlserve does not do: refused, never
    ignored (the model would run without what it was written for)."""
    for field in ("batch_input", "batch_output"):
        if len(getattr(config, field)):
            raise ConfigError(
                f"model '{name}': '{field}' (ragged batching) is not supported by dlserve"
            )


def _check_response_cache(config: Any, name: str) -> None:
    """What Triton refuses in a model that enables the response cache (its messages)."""
    if not config.response_cache.enable:
        return
    if config.HasField("sequence_batching"):
        raise ConfigError(
            f"Response Cache does not currently support model {name} with sequence batching "
            "scheduler. Please disable the response cache."
        )
    if config.model_transaction_policy.decoupled:
        raise ConfigError(
            f"Response Cache does not currently support model {name} with 'decoupled' "
            "transaction policy. Please disable the response cache."
        )


def _normalize_ensemble(config: Any, name: str) -> None:
    """An ensemble runs in the server: no backend, no instances of its own."""
    if config.backend:
        raise ConfigError(f"ensemble '{name}' must not specify a backend")
    if config.max_batch_size < 0:
        raise ConfigError(f"model '{name}': max_batch_size must be >= 0")
    _check_tensors(config, name)
    _check_response_cache(config, name)
    del config.instance_group[:]
    if not config.HasField("version_policy"):
        config.version_policy.latest.num_versions = 1


def is_ensemble(config: Any) -> bool:
    return bool(config.platform == "ensemble")


def _check_tensors(config: Any, name: str) -> None:
    from dlserve.tensors import dtypes

    for kind, entries in (("input", config.input), ("output", config.output)):
        seen: set[str] = set()
        for entry in entries:
            data_type = mc.DataType.Name(entry.data_type)
            if dtypes.from_config(data_type) is None:
                raise ConfigError(f"model '{name}': {kind} '{entry.name}' has no valid data_type")
            if entry.name in seen:
                raise ConfigError(f"model '{name}': {kind} '{entry.name}' is declared twice")
            seen.add(entry.name)
            if any(d < -1 for d in entry.dims):
                raise ConfigError(f"model '{name}': {kind} '{entry.name}' has an invalid dim")


def _normalize_instance_groups(config: Any, name: str, gpu_count: int) -> None:
    if not config.instance_group:  # named after the model, as Triton names it
        group = config.instance_group.add(name=name)
        group.kind = mc.ModelInstanceGroup.KIND_GPU if gpu_count else mc.ModelInstanceGroup.KIND_CPU
    for index, group in enumerate(config.instance_group):
        if not group.name:
            group.name = f"{name}_{index}"
        if group.count == 0:
            group.count = 1
        if group.kind == mc.ModelInstanceGroup.KIND_AUTO:
            group.kind = (
                mc.ModelInstanceGroup.KIND_GPU if gpu_count else mc.ModelInstanceGroup.KIND_CPU
            )
        if group.kind == mc.ModelInstanceGroup.KIND_GPU:
            _check_gpus(group, name, gpu_count)
        if group.count < 1:
            raise ConfigError(f"model '{name}': instance group '{group.name}' needs count >= 1")


def _check_gpus(group: Any, name: str, gpu_count: int) -> None:
    if gpu_count == 0:
        raise ConfigError(
            f"model '{name}': instance group '{group.name}' has kind KIND_GPU but no GPU is "
            "available; use KIND_CPU, or leave the kind out to run on a GPU where there is one"
        )
    if not group.gpus:
        group.gpus.extend(range(gpu_count))
    for gpu in group.gpus:
        if not 0 <= gpu < gpu_count:
            raise ConfigError(
                f"model '{name}': instance group '{group.name}' names GPU {gpu}, but only "
                f"{gpu_count} GPU(s) are available"
            )
