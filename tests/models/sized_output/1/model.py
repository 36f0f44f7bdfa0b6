"""sized_output: OUTPUT0 is SIZE bytes, each SIZE % 256."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            size = int(pb_utils.get_input_tensor_by_name(request, "SIZE").as_numpy()[0])
            output = np.full(size, size % 256, dtype=np.uint8)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", output)]))
        return responses
