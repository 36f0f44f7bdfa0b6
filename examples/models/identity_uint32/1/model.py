"""identity_uint32: OUTPUT0 = INPUT0, for UINT32 vectors of any length.

A model for Triton's Python backend; dlserve runs it unchanged. The output is made
from the input's array, which is a view of the request's memory (no copy).
"""

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            data = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            output = pb_utils.Tensor("OUTPUT0", data)
            responses.append(pb_utils.InferenceResponse(output_tensors=[output]))
        return responses
