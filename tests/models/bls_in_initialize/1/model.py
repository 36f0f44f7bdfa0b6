import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        pb_utils.InferenceRequest(
            model_name="double",
            inputs=[pb_utils.Tensor("INPUT0", np.ones(1, np.float32))],
            requested_output_names=["OUTPUT0"],
        ).exec()

    def execute(self, requests):
        return [pb_utils.InferenceResponse([]) for _ in requests]
