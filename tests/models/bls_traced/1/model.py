"""bls_traced: a BLS call made with trace=request.trace(), and one made without."""

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            assert isinstance(request.trace(), pb_utils.InferenceTrace)
            assert request.trace().get_context() is None
            inputs = [pb_utils.get_input_tensor_by_name(request, "INPUT0")]
            traced = pb_utils.InferenceRequest(
                model_name="double",
                inputs=inputs,
                requested_output_names=["OUTPUT0"],
                request_id="child",
                trace=request.trace(),
            ).exec()
            untraced = pb_utils.InferenceRequest(
                model_name="double", inputs=inputs, requested_output_names=["OUTPUT0"]
            ).exec()
            assert not traced.has_error() and not untraced.has_error()
            out = pb_utils.get_output_tensor_by_name(traced, "OUTPUT0").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", out)]))
        return responses
