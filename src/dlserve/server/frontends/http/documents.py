"""The JSON documents of Triton's HTTP routes other than inference: server and model
metadata, statistics, the repository index."""

from __future__ import annotations

from typing import Any

from dlserve.types import (
    DurationStat,
    ModelMetadata,
    ModelStatistics,
    RepositoryEntry,
    ServerMetadata,
    TensorMetadata,
)

JsonObject = dict[str, Any]


def server_metadata_json(meta: ServerMetadata) -> JsonObject:
    return {"name": meta.name, "version": meta.version, "extensions": list(meta.extensions)}


def _tensor_metadata(t: TensorMetadata) -> JsonObject:
    return {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}


def model_metadata_json(meta: ModelMetadata) -> JsonObject:
    return {
        "name": meta.name,
        "versions": list(meta.versions),
        "platform": meta.platform,
        "inputs": [_tensor_metadata(t) for t in meta.inputs],
        "outputs": [_tensor_metadata(t) for t in meta.outputs],
    }


def _duration(d: DurationStat) -> JsonObject:
    return {"count": d.count, "ns": d.ns}


def statistics_json(stats: list[ModelStatistics]) -> JsonObject:
    """Triton's statistics extension reply: ``{"model_stats": [...]}``."""
    return {"model_stats": [_model_stats(s) for s in stats]}


def _model_stats(s: ModelStatistics) -> JsonObject:
    i = s.inference_stats
    inference = {
        "success": _duration(i.success), "fail": _duration(i.fail), "queue": _duration(i.queue),
        "compute_input": _duration(i.compute_input), "compute_infer": _duration(i.compute_infer),
        "compute_output": _duration(i.compute_output), "cache_hit": _duration(i.cache_hit),
        "cache_miss": _duration(i.cache_miss),
    }  # fmt: skip
    batches = [
        {"batch_size": b.batch_size, "compute_input": _duration(b.compute_input),
         "compute_infer": _duration(b.compute_infer),
         "compute_output": _duration(b.compute_output)}
        for b in s.batch_stats
    ]  # fmt: skip
    return {
        "name": s.name, "version": s.version, "last_inference": s.last_inference_ms,
        "inference_count": s.inference_count, "execution_count": s.execution_count,
        "inference_stats": inference, "response_stats": {}, "batch_stats": batches,
        "memory_usage": [],
    }  # fmt: skip


def repository_index_json(entries: list[RepositoryEntry]) -> list[JsonObject]:
    """Triton's index rows: a model never loaded is only its name."""
    rows: list[JsonObject] = []
    for e in entries:
        row: JsonObject = {"name": e.name}
        if e.state is not None:
            if e.version:
                row["version"] = e.version
            row["state"] = e.state.value
            if e.reason:
                row["reason"] = e.reason
        rows.append(row)
    return rows
