import time

import triton_python_backend_utils as pb_utils

DELAY_S = 1.0


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            path = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            with open(path[0].decode(), "w") as fifo:
                fifo.write("started\n")
            time.sleep(DELAY_S)  # the work a test waits for
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", path)]))
        return responses
