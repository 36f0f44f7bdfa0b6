"""expand: OUT is SIZE bytes, all 1 (a small request, a large response)."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            size = int(pb_utils.get_input_tensor_by_name(request, "SIZE").as_numpy()[0])
            out = pb_utils.Tensor("OUT", np.ones(size, np.uint8))
            responses.append(pb_utils.InferenceResponse([out]))
        return responses
