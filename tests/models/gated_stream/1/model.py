import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        self.executed = 0

    def execute(self, requests):
        for request in requests:
            started, go = pb_utils.get_input_tensor_by_name(request, "CONTROL").as_numpy()
            with open(started.decode(), "w") as fifo:
                fifo.write("started\n")
            with open(go.decode()) as fifo:
                fifo.readline()  # the test says go
            output = pb_utils.Tensor("OUTPUT0", np.array([self.executed], dtype=np.int32))
            request.get_response_sender().send(pb_utils.InferenceResponse([output]), flags=FINAL)
            self.executed += 1
        return None
