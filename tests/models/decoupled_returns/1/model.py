"""decoupled_returns: a decoupled model whose execute returns responses (it must return
None: Triton fails its requests with the reason)."""

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse([pb_utils.get_input_tensor_by_name(r, "IN")])
            for r in requests
        ]
