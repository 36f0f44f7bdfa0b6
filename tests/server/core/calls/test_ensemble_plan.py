"""An ensemble's config made into a plan: steps in dependency order, or a clear refusal."""

from __future__ import annotations

from typing import Any

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from dlserve.server.core.calls.ensemble import plan_ensemble
from dlserve.server.core.models.config import ConfigError


def step(model: str, inputs: dict[str, str], outputs: dict[str, str], version: int = -1) -> str:
    maps = "".join(f' input_map {{ key: "{k}" value: "{v}" }}' for k, v in inputs.items())
    maps += "".join(f' output_map {{ key: "{k}" value: "{v}" }}' for k, v in outputs.items())
    return f'{{ model_name: "{model}" model_version: {version}{maps} }}'


def config(*steps: str, outputs: tuple[str, ...] = ("OUT",)) -> Any:
    outs = ", ".join(f'{{ name: "{o}" data_type: TYPE_FP32 dims: [ -1 ] }}' for o in outputs)
    text = (
        'name: "ens" platform: "ensemble" '
        'input [ { name: "IN" data_type: TYPE_FP32 dims: [ -1 ] } ] '
        f"output [ {outs} ] ensemble_scheduling {{ step [ {', '.join(steps)} ] }}"
    )
    return text_format.Parse(text, mc.ModelConfig())


def test_steps_are_ordered_by_what_they_need() -> None:
    plan = plan_ensemble(config(
        step("last", {"X": "B"}, {"Y": "OUT"}),
        step("first", {"X": "IN"}, {"Y": "A"}),
        step("middle", {"X": "A"}, {"Y": "B"}, version=2),
    ))  # fmt: skip
    assert [s.model_name for s in plan.steps] == ["first", "middle", "last"]
    assert [s.model_version for s in plan.steps] == ["", "2", ""]
    assert plan.models == ["first", "last", "middle"]


def test_a_cycle_or_a_tensor_nobody_makes_is_refused() -> None:
    with pytest.raises(ConfigError, match="no step can run"):
        plan_ensemble(config(
            step("a", {"X": "B"}, {"Y": "A"}),
            step("b", {"X": "A"}, {"Y": "B"}),
            step("c", {"X": "IN"}, {"Y": "OUT"}),
        ))  # fmt: skip


def test_an_output_made_twice_or_never_is_refused() -> None:
    with pytest.raises(ConfigError, match="output of more than one step"):
        plan_ensemble(config(step("a", {"X": "IN"}, {"Y": "OUT"}),
                             step("b", {"X": "IN"}, {"Y": "OUT"})))  # fmt: skip
    with pytest.raises(ConfigError, match=r"output\(s\) \['OTHER'\] are not produced"):
        plan_ensemble(config(step("a", {"X": "IN"}, {"Y": "OUT"}), outputs=("OUT", "OTHER")))


def test_an_ensemble_needs_steps() -> None:
    empty = text_format.Parse('name: "ens" platform: "ensemble"', mc.ModelConfig())
    with pytest.raises(ConfigError, match="must specify ensemble_scheduling"):
        plan_ensemble(empty)
