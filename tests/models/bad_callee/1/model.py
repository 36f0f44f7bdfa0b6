"""bad_callee: OUTPUT0 = INPUT0, PID = [its process id], HELD = [how many pieces of its
output arena were in use when execute began]. When INPUT0's first element is negative,
OUTPUT0's name is made bytes behind pb_utils' back (a private attribute), so its reply is
a frame whoever reads it (the server, or a direct caller) cannot read."""

import os

import numpy as np
import triton_python_backend_utils as pb_utils

from dlserve.worker.link import link


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        held = len(link.current().memory.output_arena._used)
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            output = pb_utils.Tensor("OUTPUT0", x)
            if x.size and x[0] < 0:
                output._name = b"OUTPUT0"
            pid = pb_utils.Tensor("PID", np.array([os.getpid()], dtype=np.int64))
            in_use = pb_utils.Tensor("HELD", np.array([held], dtype=np.int64))
            responses.append(pb_utils.InferenceResponse([output, pid, in_use]))
        return responses
