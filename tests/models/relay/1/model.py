"""relay: calls bls_direct in "calls" mode (double(x), the request's "count" times), so
that bls_direct's own direct calls are made on behalf of another direct call.
OUTPUT0 = bls_direct's OUTPUT0."""

import json

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            count = json.loads(request.parameters())["count"]
            call = pb_utils.InferenceRequest(
                model_name="bls_direct",
                inputs=[pb_utils.get_input_tensor_by_name(request, "INPUT0")],
                requested_output_names=["OUTPUT0"],
                parameters={"mode": "calls", "count": count},
            )
            response = call.exec()
            if response.has_error():
                responses.append(pb_utils.InferenceResponse(error=response.error()))
                continue
            output = pb_utils.get_output_tensor_by_name(response, "OUTPUT0")
            responses.append(pb_utils.InferenceResponse([output]))
        return responses
