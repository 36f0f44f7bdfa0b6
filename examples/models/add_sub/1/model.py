"""add_sub: OUTPUT0 = INPUT0 + INPUT1 and OUTPUT1 = INPUT0 - INPUT1.

A model for Triton's Python backend; dlserve runs it unchanged.
"""

import json
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Adds and subtracts two tensors of the same shape."""

    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        self.output_dtypes = {
            name: pb_utils.triton_string_to_numpy(
                pb_utils.get_output_config_by_name(config, name)["data_type"]
            )
            for name in ("OUTPUT0", "OUTPUT1")
        }

    def execute(self, requests: list[Any]) -> list[Any]:
        return [self._compute(request) for request in requests]

    def _compute(self, request: Any) -> Any:
        in0 = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
        in1 = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
        out0 = np.add(in0, in1).astype(self.output_dtypes["OUTPUT0"], copy=False)
        out1 = np.subtract(in0, in1).astype(self.output_dtypes["OUTPUT1"], copy=False)
        return pb_utils.InferenceResponse(
            output_tensors=[
                pb_utils.Tensor("OUTPUT0", out0),
                pb_utils.Tensor("OUTPUT1", out1),
            ]
        )

    def finalize(self) -> None:
        pass
