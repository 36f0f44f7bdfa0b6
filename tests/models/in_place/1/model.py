"""in_place: proves as_numpy() is a view of the request's memory, not a copy.

The model writes into the first as_numpy() array, then builds the output from a
second as_numpy() call: the output shows the write only if both are the same memory.
"""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            tensor = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            first = tensor.as_numpy()
            first += 1
            second = tensor.as_numpy()
            outputs = [
                pb_utils.Tensor("OUTPUT0", second),
                pb_utils.Tensor("SAME_MEMORY", np.array([np.shares_memory(first, second)])),
            ]
            responses.append(pb_utils.InferenceResponse(outputs))
        return responses
