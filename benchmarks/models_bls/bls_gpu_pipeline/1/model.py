"""OUTPUT_0 = gpu_plus1(gpu_times2(INPUT_0)) through BLS, the tensors staying on the GPU."""

import triton_python_backend_utils as pb_utils


def call(model, tensor):
    request = pb_utils.InferenceRequest(
        model_name=model, inputs=[tensor], requested_output_names=["OUTPUT_0"]
    )
    response = request.exec()
    if response.has_error():
        raise pb_utils.TritonModelException(response.error().message())
    return pb_utils.get_output_tensor_by_name(response, "OUTPUT_0")


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            data = pb_utils.get_input_tensor_by_name(request, "INPUT_0")
            doubled = call("gpu_times2", data)
            result = call("gpu_plus1", pb_utils.Tensor.from_dlpack("INPUT_0", doubled))
            output = pb_utils.Tensor.from_dlpack("OUTPUT_0", result)
            responses.append(pb_utils.InferenceResponse([output]))
        return responses
