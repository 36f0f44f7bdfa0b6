"""OUTPUT_0 = INPUT_0 * 2 on the GPU, with torch through DLPack (no copy in or out)."""

import triton_python_backend_utils as pb_utils
from torch.utils.dlpack import from_dlpack, to_dlpack


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            tensor = pb_utils.get_input_tensor_by_name(request, "INPUT_0")
            data = from_dlpack(tensor.to_dlpack())
            if not data.is_cuda:
                data = data.cuda()
            output = pb_utils.Tensor.from_dlpack("OUTPUT_0", to_dlpack(data * 2))
            responses.append(pb_utils.InferenceResponse([output]))
        return responses
