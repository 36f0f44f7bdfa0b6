import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def execute(self, requests):
        batch = np.array([[len(requests)]], dtype=np.int32)
        for request in requests:
            response = pb_utils.InferenceResponse([pb_utils.Tensor("BATCH", batch)])
            request.get_response_sender().send(response, flags=FINAL)
        return None
