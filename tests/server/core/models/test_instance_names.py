"""Model instances named as Triton names them: ``<group>_<i>`` for i below the group's
count, on each of its GPUs; a config without ``instance_group`` gets one group named after
the model, unnamed groups ``<model>_<group index>``."""

from __future__ import annotations

from typing import Any

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from dlserve.server.core.models.config import normalize
from dlserve.server.core.models.versions import instance_specs

TENSORS = """
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""


def specs(groups: str, gpus: int = 0) -> list[tuple[str, str, int]]:
    config: Any = text_format.Parse(TENSORS + groups, mc.ModelConfig())
    normalize(config, "m", gpus)
    return [(spec.name, spec.kind, spec.device_id) for spec in instance_specs(config)]


def test_without_instance_group_the_group_is_named_after_the_model() -> None:
    assert specs("") == [("m_0", "CPU", 0)]
    assert specs("", gpus=1) == [("m_0", "GPU", 0)]


def test_unnamed_groups_are_numbered_and_named_groups_keep_their_names() -> None:
    groups = 'instance_group [ { count: 2 kind: KIND_CPU }, { name: "g" count: 2 kind: KIND_CPU } ]'
    assert [name for name, _, _ in specs(groups)] == ["m_0_0", "m_0_1", "g_0", "g_1"]


def test_a_group_on_two_gpus_has_each_name_on_each_gpu() -> None:
    groups = "instance_group [ { count: 2 kind: KIND_GPU gpus: [ 0, 1 ] } ]"
    assert sorted(specs(groups, gpus=2)) == [
        ("m_0_0", "GPU", 0), ("m_0_0", "GPU", 1), ("m_0_1", "GPU", 0), ("m_0_1", "GPU", 1),
    ]  # fmt: skip
