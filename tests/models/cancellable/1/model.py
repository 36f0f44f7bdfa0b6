"""cancellable: waits in execute until is_cancelled() says its client went away."""

import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.cancelled = 0

    def execute(self, requests):
        responses = []
        for request in requests:
            what = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()[0].decode()
            if what != "report":
                with open(what, "w") as fifo:
                    fifo.write("started\n")
                deadline = time.monotonic() + 30
                while not request.is_cancelled() and time.monotonic() < deadline:
                    time.sleep(0.01)  # the model's own pace
                self.cancelled += int(request.is_cancelled())
            output = pb_utils.Tensor("OUTPUT0", np.array([self.cancelled], dtype=np.int32))
            responses.append(pb_utils.InferenceResponse([output]))
        return responses
