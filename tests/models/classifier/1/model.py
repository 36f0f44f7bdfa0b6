import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            data = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            outputs = [
                pb_utils.Tensor("OUTPUT0", data),
                pb_utils.Tensor("OUTPUT1", (data * 10).astype(np.int32)),
                pb_utils.Tensor("OUTPUT2", data.astype(np.float16)),
            ]
            responses.append(pb_utils.InferenceResponse(outputs))
        return responses
