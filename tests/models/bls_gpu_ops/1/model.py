"""bls_gpu_ops: torch on the GPU; see config.pbtxt. torch is imported in execute only, so the
model loads where torch or a GPU is missing (the tests that use it need both)."""

import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        import torch

        responses = []
        for request in requests:
            op = json.loads(request.parameters()).get("op", "double")
            tensor = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            x = torch.from_dlpack(tensor)
            if not x.is_cuda:
                x = x.cuda()
            if op == "add_one_in_place":
                x += 1
                result = x
            elif op == "add_one_in_place_late":  # behind a GPU sleep; answers from the host
                for _ in range(200):  # short kernels: the GPU may switch to the reader between them
                    torch.cuda._sleep(2_000_000)
                x += 1
                responses.append(
                    pb_utils.InferenceResponse(
                        [pb_utils.Tensor("OUTPUT0", np.zeros(1, dtype=np.float32))]
                    )
                )
                continue
            elif op == "double_late":  # behind a GPU sleep; answers with a GPU tensor
                for _ in range(200):
                    torch.cuda._sleep(2_000_000)
                result = x * 2
            else:
                result = x * 2 if op == "double" else x + 1
            output = pb_utils.Tensor.from_dlpack("OUTPUT0", result)
            responses.append(pb_utils.InferenceResponse([output]))
        return responses
