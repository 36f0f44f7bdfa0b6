"""instance_names: each instance leaves a file named after it in <model folder>/instances."""

import os

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        folder = os.path.join(args["model_repository"], "instances")
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, args["model_instance_name"]), "w"):
            pass

    def execute(self, requests):
        responses = []
        for request in requests:
            data = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", data)]))
        return responses
