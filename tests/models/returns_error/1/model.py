"""returns_error: answers every request with a TritonError of the code it asks for."""

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            code = int(pb_utils.get_input_tensor_by_name(request, "CODE").as_numpy()[0])
            error = pb_utils.TritonError(f"returns_error: code {code} on purpose", code)
            responses.append(pb_utils.InferenceResponse(error=error))
        return responses
