"""cached: OUTPUT0 = INPUT0 * 2 (+ the "offset" parameter), OUTPUT1 = executions so far."""

import json

import numpy as np
import triton_python_backend_utils as pb_utils

FACTOR = 2


class TritonPythonModel:
    def initialize(self, args):
        self.executions = 0

    def execute(self, requests):
        self.executions += 1
        responses = []
        for request in requests:
            parameters = json.loads(request.parameters())
            if parameters.get("fail"):
                error = pb_utils.TritonError("asked to fail")
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            data = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            offset = np.float32(parameters.get("offset", 0))
            out0 = (data * FACTOR + offset).astype(np.float32)
            out1 = np.array([self.executions], dtype=np.int64)
            tensors = [pb_utils.Tensor("OUTPUT0", out0), pb_utils.Tensor("OUTPUT1", out1)]
            wanted = request.requested_output_names()
            if wanted:
                tensors = [t for t in tensors if t.name() in wanted]
            responses.append(pb_utils.InferenceResponse(tensors))
        return responses
