"""reshape: returns the transpose of the [2, 2] it is given, and the shape it saw."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            tensor = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            outputs = [
                pb_utils.Tensor("OUTPUT0", tensor.as_numpy().T),
                pb_utils.Tensor("SEEN_SHAPE", np.array(tensor.shape(), dtype=np.int64)),
            ]
            responses.append(pb_utils.InferenceResponse(outputs))
        return responses
