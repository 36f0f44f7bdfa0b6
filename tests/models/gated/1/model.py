import os

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            started, go = pb_utils.get_input_tensor_by_name(request, "CONTROL").as_numpy()
            with open(started.decode(), "w") as fifo:
                fifo.write("started\n")
            with open(go.decode()) as fifo:
                fifo.readline()  # the test says go
            data = pb_utils.get_input_tensor_by_name(request, "DATA").as_numpy()
            if (data == -1).any():  # a crash mid-request (test_prefetch.py)
                os._exit(1)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", data * 2)]))
        return responses
