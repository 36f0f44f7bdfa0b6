"""stream_fails: one response, then execute raises (MODE b"raise") or returns a
list of responses (MODE b"return"), which a decoupled model must not."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        modes = []
        for request in requests:
            mode = pb_utils.get_input_tensor_by_name(request, "MODE").as_numpy()[0]
            modes.append(mode)
            output = pb_utils.Tensor("OUTPUT0", np.ones(1, dtype=np.float32))
            request.get_response_sender().send(pb_utils.InferenceResponse([output]))
        if b"return" in modes:
            return [pb_utils.InferenceResponse([]) for _ in requests]
        raise ValueError("stream_fails: on purpose")
