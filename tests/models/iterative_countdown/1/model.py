"""iterative_countdown: for a request with IN = n, each execute sends one response with
OUT = the responses still to come (n-1, ..., 0; the last with the final flag) and
reschedules the request until then."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.remaining = {}

    def execute(self, requests):
        for request in requests:
            key = request.request_id()
            if key not in self.remaining:
                total = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy().item()
                self.remaining[key] = int(total)
            self.remaining[key] -= 1
            left = self.remaining[key]
            out = pb_utils.Tensor("OUT", np.array([left], np.int32))
            response = pb_utils.InferenceResponse([out])
            sender = request.get_response_sender()
            if left <= 0:
                del self.remaining[key]
                sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            else:
                request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
                sender.send(response)
        return None
