import json

import numpy as np
import triton_python_backend_utils as pb_utils


def line(path, text=None):
    if text is None:
        with open(path) as fifo:
            return fifo.readline()
    with open(path, "w") as fifo:
        fifo.write(text)
    return text


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            params = json.loads(request.parameters())
            if "started" in params:
                line(params["started"], "started\n")
                line(params["go"])
            batch = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy().shape[0]
            timeout = np.full((batch, 1), request.timeout(), dtype=np.uint64)
            text = np.full((batch, 1), request.parameters(), dtype=np.object_)
            responses.append(
                pb_utils.InferenceResponse(
                    [pb_utils.Tensor("TIMEOUT", timeout), pb_utils.Tensor("PARAMETERS", text)]
                )
            )
        return responses
