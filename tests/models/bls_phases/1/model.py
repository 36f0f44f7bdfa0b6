"""bls_phases: BLS calls from initialize and finalize, which Triton refuses."""

import asyncio
import json

import numpy as np
import triton_python_backend_utils as pb_utils


def request():
    return pb_utils.InferenceRequest(
        model_name="double",
        inputs=[pb_utils.Tensor("INPUT0", np.ones(1, np.float32))],
        requested_output_names=["OUTPUT0"],
    )


def raised(function):
    try:
        function()
    except pb_utils.TritonModelException as exc:
        return str(exc)
    return None


class TritonPythonModel:
    def initialize(self, args):
        self.initialized = {
            "exec": raised(lambda: request().exec()),
            "async_exec": raised(lambda: asyncio.run(request().async_exec())),
        }
        self.finalized = None

    def execute(self, requests):
        responses = []
        for each in requests:
            self.finalized = json.loads(each.parameters()).get("finalized")
            response = request().exec()  # allowed here
            doubled = float(pb_utils.get_output_tensor_by_name(response, "OUTPUT0").as_numpy()[0])
            report = {**self.initialized, "execute": doubled}
            text = np.array([json.dumps(report)], dtype=np.object_)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("REPORT", text)]))
        return responses

    def finalize(self):
        if self.finalized is not None:
            with open(self.finalized, "w") as fifo:
                fifo.write(raised(lambda: request().exec()) + "\n")
