"""identity_bf16: OUTPUT0 = INPUT0, bit for bit, for BF16 vectors of any length.

numpy has no bfloat16, so ``as_numpy()`` is refused for BF16 (as in Triton): the
output is made from the input by DLPack, sharing its memory. No framework (torch)
is needed; a model that computes would hand the capsule to one, e.g.
``torch.utils.dlpack.from_dlpack(tensor.to_dlpack())``.
"""

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            tensor = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            output = pb_utils.Tensor.from_dlpack("OUTPUT0", tensor.to_dlpack())
            responses.append(pb_utils.InferenceResponse(output_tensors=[output]))
        return responses
