"""``pb_utils.ModelConfig``: the configuration ``auto_complete_config`` may complete.

The model gets the configuration as Triton's JSON form (a dict) and may set the
max batch size, the dynamic batcher, inputs, outputs and the transaction policy.
Conflicts with what config.pbtxt already says are refused with Triton's messages.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from typing import Any, Final

_INPUT_PROPERTIES: Final = ("name", "data_type", "dims", "optional")
_OUTPUT_PROPERTIES: Final = ("name", "data_type", "dims")


class ModelConfig:
    """Triton's auto-complete view of a model configuration."""

    def __init__(self, model_config: Mapping[str, Any] | str) -> None:
        if isinstance(model_config, str):
            config: dict[str, Any] = json.loads(model_config)
        else:
            config = copy.deepcopy(dict(model_config))
        config.setdefault("name", "")
        config.setdefault("max_batch_size", 0)
        config.setdefault("input", [])
        config.setdefault("output", [])
        self._model_config = config

    @property
    def _name(self) -> str:
        return str(self._model_config["name"])

    def as_dict(self) -> dict[str, Any]:
        """The configuration as a dict (treat it as read-only)."""
        return self._model_config

    def set_max_batch_size(self, max_batch_size: int) -> None:
        current = int(self._model_config["max_batch_size"])
        if current > max_batch_size:
            raise ValueError(
                f"configuration specified max_batch_size {current}, but in auto-complete-config "
                f"function for model '{self._name}' specified max_batch_size {max_batch_size}"
            )
        self._model_config["max_batch_size"] = max_batch_size

    def set_dynamic_batching(self) -> None:
        for scheduler in ("sequence_batching", "ensemble_scheduling"):
            if self._model_config.get(scheduler):
                raise ValueError(
                    f"Configuration specified scheduling_choice as '{scheduler}', but "
                    f"auto-complete-config function for model '{self._name}' tries to set "
                    "scheduling_choice as 'dynamic_batching'"
                )
        if not self._model_config.get("dynamic_batching"):
            self._model_config["dynamic_batching"] = {}

    def add_input(self, input: Mapping[str, Any]) -> None:
        self._add_tensor("input", dict(input), _INPUT_PROPERTIES)

    def add_output(self, output: Mapping[str, Any]) -> None:
        self._add_tensor("output", dict(output), _OUTPUT_PROPERTIES)

    def _add_tensor(self, kind: str, tensor: dict[str, Any], allowed: tuple[str, ...]) -> None:
        self._check_properties(kind, tensor, allowed)
        for existing in self._model_config[kind]:
            if existing.get("name") == tensor["name"]:
                self._merge(kind, existing, tensor)
                return
        self._model_config[kind].append(tensor)

    def _check_properties(
        self, kind: str, tensor: dict[str, Any], allowed: tuple[str, ...]
    ) -> None:
        label = (
            f"{kind} '{tensor.get('name', '')}' in auto-complete-config function for model "
            f"'{self._name}'"
        )
        if any(key not in allowed for key in tensor):
            names = ", ".join(f"'{p}'" for p in allowed[:-1]) + f" and '{allowed[-1]}'"
            raise ValueError(f"{label} contains property other than {names}.")
        if "name" not in tensor:
            raise ValueError(
                f"{kind} in auto-complete-config function for model '{self._name}' is missing "
                "'name' property."
            )
        for required in ("data_type", "dims"):
            if required not in tensor:
                raise ValueError(f"{label} is missing '{required}' property.")

    def _merge(self, kind: str, existing: dict[str, Any], tensor: dict[str, Any]) -> None:
        name = tensor["name"]
        declared_type = existing.get("data_type", "TYPE_INVALID")
        if declared_type != "TYPE_INVALID" and declared_type != tensor["data_type"]:
            raise ValueError(
                f"unable to load model '{self._name}', configuration expects datatype "
                f"{declared_type} for {kind} '{name}', model provides {tensor['data_type']}"
            )
        declared_dims = [int(d) for d in existing.get("dims", [])]
        if declared_dims and declared_dims != [int(d) for d in tensor["dims"]]:
            raise ValueError(
                f"model '{self._name}', tensor '{name}': the model expects dims "
                f"{list(tensor['dims'])} but the model configuration specifies dims "
                f"{declared_dims}"
            )
        optional = tensor.get("optional")
        if optional is not None and "optional" in existing and existing["optional"] != optional:
            raise ValueError(
                f"model '{self._name}', tensor '{name}': the model expects optional "
                f"{tensor['optional']} but the model configuration specifies optional "
                f"{existing['optional']}"
            )
        existing["data_type"] = tensor["data_type"]
        existing["dims"] = list(tensor["dims"])
        if "optional" in tensor:
            existing["optional"] = tensor["optional"]

    def set_model_transaction_policy(self, transaction_policy_dict: Mapping[str, Any]) -> None:
        for key in transaction_policy_dict:
            if key != "decoupled":
                raise ValueError(
                    "model transaction property in auto-complete-config function for model "
                    f"'{self._name}' contains property other than 'decoupled'."
                )
        policy = self._model_config.setdefault("model_transaction_policy", {})
        if "decoupled" not in transaction_policy_dict:
            return
        wanted = transaction_policy_dict["decoupled"]
        if "decoupled" in policy and policy["decoupled"] != wanted:
            raise ValueError(
                "trying to change decoupled property in auto-complete-config for model "
                f"'{self._name}', which is already set to '{policy['decoupled']}'."
            )
        policy["decoupled"] = wanted
