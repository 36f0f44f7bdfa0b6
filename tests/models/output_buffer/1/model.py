"""output_buffer: OUTPUT0 = INPUT0 * 2, written into pb_utils.get_output_buffer's tensor.

The model returns that very tensor, so its bytes are already where they must go (the
worker's output arena, or the client's region). The response's parameters say whether the
buffer was writable and on the host.
"""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            data = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            out = pb_utils.get_output_buffer(request, "OUTPUT0", list(data.shape), "FP32")
            view = out.as_numpy()
            np.multiply(data, 2, out=view)
            params = {"writable": bool(view.flags.writeable), "is_cpu": out.is_cpu()}
            responses.append(pb_utils.InferenceResponse([out], parameters=params))
        return responses
