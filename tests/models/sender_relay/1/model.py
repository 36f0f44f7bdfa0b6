"""sender_relay: calls default_sender (or the model its "callee" parameter names) with this
request's IN and parameters (a call with a timeout goes through the server, one without
straight to the callee's instance)."""

import json

import triton_python_backend_utils as pb_utils

THROUGH_SERVER_TIMEOUT = 600 * 10**9  # any timeout: such a call is not made directly


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            params = json.loads(request.parameters())
            through = params.pop("through", "direct")
            call = pb_utils.InferenceRequest(
                model_name=params.pop("callee", "default_sender"),
                inputs=[pb_utils.get_input_tensor_by_name(request, "IN")],
                requested_output_names=["OUT"],
                parameters=params,
                timeout=THROUGH_SERVER_TIMEOUT if through == "server" else 0,
            )
            response = call.exec()
            if response.has_error():
                responses.append(pb_utils.InferenceResponse(error=response.error()))
                continue
            output = pb_utils.get_output_tensor_by_name(response, "OUT")
            responses.append(pb_utils.InferenceResponse([output]))
        return responses
