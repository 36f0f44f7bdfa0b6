"""A decoupled stateful accumulator behind the sequence batcher: one running sum per
instance, reset by START; each request gets two responses (the sum before and after its
INPUT is added), then the final flag."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.sum = 0

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            start = pb_utils.get_input_tensor_by_name(request, "START").as_numpy()
            if start.reshape(-1)[0]:
                self.sum = 0
            for add in (0, int(pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()[0])):
                self.sum += add
                sum_ = pb_utils.Tensor("SUM", np.array([self.sum], np.int32))
                sender.send(pb_utils.InferenceResponse([sum_]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
