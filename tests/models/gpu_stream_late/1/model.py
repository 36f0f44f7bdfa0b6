"""gpu_stream_late: see config.pbtxt."""

import numpy as np
import torch
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            view = torch.from_dlpack(pb_utils.get_input_tensor_by_name(request, "INPUT_0"))
            for _ in range(200):  # short kernels: the GPU may switch to the reader between them
                torch.cuda._sleep(2_000_000)
            view += 1
            sender = request.get_response_sender()
            output = pb_utils.Tensor("OUTPUT_0", np.zeros(1, dtype=np.float32))
            sender.send(pb_utils.InferenceResponse([output]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
