"""Trace settings, sampling, file writing and the TENSORS text, without a server."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dlserve.errors import InvalidArgumentError
from dlserve.server.core.telemetry.trace_config import parse_trace_config
from dlserve.server.core.telemetry.trace_format import tensor_text
from dlserve.server.core.telemetry.tracer import Tracer
from dlserve.tensors import dtypes


def startup(path: Path, *config: str) -> dict[str, list[str]]:
    return parse_trace_config([*config, f"triton,file={path}"])


def test_trace_config_is_read_as_triton_reads_it(tmp_path: Path) -> None:
    assert parse_trace_config([]) == {}
    settings = parse_trace_config(
        ["level=timestamps", "level=TENSORS", "rate=10", "count=3", "mode=triton",
         "triton,file=t.json", "triton,log-frequency=5"], cwd=str(tmp_path),
    )  # fmt: skip
    assert settings == {
        "trace_level": ["TIMESTAMPS", "TENSORS"], "trace_rate": ["10"], "trace_count": ["3"],
        "trace_file": [f"{tmp_path}/t.json"], "log_frequency": ["5"],
    }  # fmt: skip
    # an explicit OFF wins over the other levels, as in Triton
    off = parse_trace_config(["level=TIMESTAMPS", "level=OFF"])
    assert off["trace_level"] == ["OFF"]


def test_sampling_every_rate_th_request_while_count_lasts(tmp_path: Path) -> None:
    tracer = Tracer(startup(tmp_path / "t.json", "level=TIMESTAMPS", "rate=2", "count=2"))
    taken = [tracer.sample("m") is not None for _ in range(8)]
    assert taken == [False, True, False, True, False, False, False, False]
    assert tracer.settings.get()["trace_count"] == ["0"] and not tracer.active


def test_model_setting_counts_on_its_own_and_updates_start_counting_again(
    tmp_path: Path,
) -> None:
    tracer = Tracer(startup(tmp_path / "t.json", "level=TIMESTAMPS", "rate=3"))
    settings = tracer.settings
    settings.update("m", {"trace_rate": ["1"], "trace_count": ["2"]})
    assert tracer.sample("m") is not None and tracer.sample("other") is None
    assert settings.get("m")["trace_count"] == ["1"]
    settings.update("", {"trace_rate": ["2"]})  # the model's own count goes on
    assert settings.get("m")["trace_count"] == ["1"]
    assert settings.get("m")["trace_rate"] == ["1"]
    assert [tracer.sample("other") is not None for _ in range(2)] == [False, True]
    with pytest.raises(InvalidArgumentError, match="sample rate must be non-zero"):
        settings.update("", {"trace_rate": ["0"]})
    assert settings.get()["trace_rate"] == ["2"]  # all or nothing


def test_traces_are_written_with_children_when_the_last_is_released(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    tracer = Tracer(startup(path, "level=TIMESTAMPS", "rate=1"))
    root = tracer.sample("ens")
    assert root is not None
    root.started("ens", 1, "r1", 10)
    child = root.child("step")
    child.started("step", 2, "", 11)
    root.release()
    child.stamp("REQUEST_END", 12)
    child.release()
    tracer.close()
    entries = json.loads(path.read_text())
    assert entries == [
        {"id": 1, "model_name": "ens", "model_version": 1, "request_id": "r1"},
        {"id": 1, "timestamps": [{"name": "REQUEST_START", "ns": 10}]},
        {"id": 2, "model_name": "step", "model_version": 2, "parent_id": 1},
        {"id": 2, "timestamps": [{"name": "REQUEST_START", "ns": 11}]},
        {"id": 2, "timestamps": [{"name": "REQUEST_END", "ns": 12}]},
    ]


def test_an_update_writes_the_replaced_settings_traces(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    tracer = Tracer(startup(path, "level=TIMESTAMPS", "rate=1"))
    first = tracer.sample("m")
    assert first is not None
    tracer.settings.update("", {"trace_rate": ["1"]})  # retired while the trace is open
    assert not path.exists()
    first.release()  # its setting's last trace: written now
    second = tracer.sample("m")
    assert second is not None
    second.release()
    tracer.close()
    assert [e["id"] for e in json.loads(path.read_text()) if "model_name" in e] == [1, 2]


@pytest.mark.parametrize(
    ("datatype", "values", "text"),
    [
        ("FP32", [0.1, 1e-7, 100000.0, 1234567.0], "0.1,1e-07,100000,1.23457e+06"),
        ("FP64", [2.5, -3.0], "2.5,-3"),
        ("INT8", [-1, 7], "-1,7"),
        ("UINT64", [2**64 - 1], "18446744073709551615"),
        ("BOOL", [True, False], "1,0"),
        ("FP16", [1.0], ""),
    ],
)
def test_tensor_text_as_triton_writes_it(datatype: str, values: list[object], text: str) -> None:
    dtype = dtypes.from_wire(datatype)
    assert dtype is not None and dtype.numpy is not None
    data = np.array(values, dtype=dtype.numpy).tobytes()
    assert tensor_text(datatype, data) == text


def test_tensor_text_of_bytes_and_of_bytes_that_do_not_fit() -> None:
    data = dtypes.serialize_bytes(np.array([b"ab", b"\xff"], dtype=np.object_))
    assert tensor_text("BYTES", data) == '"ab","\\xff"'
    assert tensor_text("FP32", b"\x00\x00\x00") is None
