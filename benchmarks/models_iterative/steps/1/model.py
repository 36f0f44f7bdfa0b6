import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.step_s = float(config["parameters"]["STEP_MS"]["string_value"]) / 1000
        self.done = {}

    def execute(self, requests):
        time.sleep(self.step_s)  # one batched step, whatever the batch size
        responses = []
        for request in requests:
            key = request.request_id()
            steps = int(pb_utils.get_input_tensor_by_name(request, "STEPS").as_numpy().item())
            self.done[key] = self.done.get(key, 0) + 1
            if self.done[key] < steps:
                request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
                responses.append(None)
            else:
                done = self.done.pop(key)
                out = pb_utils.Tensor("DONE", np.array([[done]], np.int32))
                responses.append(pb_utils.InferenceResponse([out]))
        return responses
