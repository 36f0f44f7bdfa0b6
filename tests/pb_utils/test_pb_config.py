"""pb_utils.ModelConfig: what auto_complete_config may change, with Triton's refusals."""

from __future__ import annotations

from typing import Any

import pytest

from dlserve import pb_utils as pb_utils


def config(**fields: Any) -> dict[str, Any]:
    return {"name": "m", "max_batch_size": 0, "input": [], "output": [], **fields}


def test_as_dict_is_a_copy_of_the_given_dict() -> None:
    given = config()
    model_config = pb_utils.ModelConfig(given)
    model_config.add_input({"name": "I", "data_type": "TYPE_FP32", "dims": [2]})
    assert given["input"] == []
    assert model_config.as_dict()["input"] == [{"name": "I", "data_type": "TYPE_FP32", "dims": [2]}]
    assert pb_utils.ModelConfig('{"name": "j"}').as_dict()["input"] == []


def test_max_batch_size_may_grow_only() -> None:
    model_config = pb_utils.ModelConfig(config(max_batch_size=4))
    model_config.set_max_batch_size(8)
    assert model_config.as_dict()["max_batch_size"] == 8
    with pytest.raises(ValueError, match="configuration specified max_batch_size 8"):
        model_config.set_max_batch_size(2)


def test_dynamic_batching() -> None:
    model_config = pb_utils.ModelConfig(config())
    model_config.set_dynamic_batching()
    assert model_config.as_dict()["dynamic_batching"] == {}
    sequence = pb_utils.ModelConfig(config(sequence_batching={"max_sequence_idle_microseconds": 1}))
    with pytest.raises(ValueError, match="scheduling_choice as 'sequence_batching'"):
        sequence.set_dynamic_batching()


def test_inputs_merge_with_the_declared_ones() -> None:
    declared = {"name": "I", "data_type": "TYPE_INVALID", "dims": [], "optional": False}
    model_config = pb_utils.ModelConfig(config(input=[declared]))
    model_config.add_input({"name": "I", "data_type": "TYPE_INT8", "dims": [3]})
    model_config.add_output({"name": "O", "data_type": "TYPE_INT8", "dims": [3]})
    as_dict = model_config.as_dict()
    assert as_dict["input"] == [
        {"name": "I", "data_type": "TYPE_INT8", "dims": [3], "optional": False}
    ]
    assert as_dict["output"] == [{"name": "O", "data_type": "TYPE_INT8", "dims": [3]}]


@pytest.mark.parametrize(
    ("tensor", "message"),
    [
        (
            {"name": "I", "data_type": "TYPE_FP32", "dims": [1], "shape": 1},
            "contains property other",
        ),
        ({"data_type": "TYPE_FP32", "dims": [1]}, "missing 'name'"),
        ({"name": "I", "dims": [1]}, "missing 'data_type'"),
        ({"name": "I", "data_type": "TYPE_FP32"}, "missing 'dims'"),
        ({"name": "D", "data_type": "TYPE_FP64", "dims": [2]}, "expects datatype TYPE_FP32"),
        ({"name": "D", "data_type": "TYPE_FP32", "dims": [3]}, "the model expects dims"),
        ({"name": "D", "data_type": "TYPE_FP32", "dims": [2], "optional": True}, "optional"),
    ],
)
def test_input_refusals(tensor: dict[str, Any], message: str) -> None:
    declared = {"name": "D", "data_type": "TYPE_FP32", "dims": [2], "optional": False}
    with pytest.raises(ValueError, match=message):
        pb_utils.ModelConfig(config(input=[declared])).add_input(tensor)


def test_output_refuses_optional() -> None:
    with pytest.raises(ValueError, match="other than 'name', 'data_type' and 'dims'"):
        pb_utils.ModelConfig(config()).add_output(
            {"name": "O", "data_type": "TYPE_FP32", "dims": [1], "optional": True}
        )


def test_transaction_policy() -> None:
    model_config = pb_utils.ModelConfig(config())
    model_config.set_model_transaction_policy({"decoupled": True})
    assert model_config.as_dict()["model_transaction_policy"] == {"decoupled": True}
    with pytest.raises(ValueError, match="trying to change decoupled property"):
        model_config.set_model_transaction_policy({"decoupled": False})
    with pytest.raises(ValueError, match="other than 'decoupled'"):
        model_config.set_model_transaction_policy({"streaming": True})
