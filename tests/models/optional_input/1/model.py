"""optional_input: pb_utils.get_input_tensor_by_name returns None for an absent optional input."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            in0 = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            in1 = pb_utils.get_input_tensor_by_name(request, "INPUT1")
            result = in0 if in1 is None else in0 + in1.as_numpy()
            outputs = [
                pb_utils.Tensor("OUTPUT0", result),
                pb_utils.Tensor("OUTPUT1", np.array([in1 is not None])),
            ]
            responses.append(pb_utils.InferenceResponse(outputs))
        return responses
