"""Reports how it was executed: OUTPUT0 = INPUT0 * 2, BATCH = how many requests the
execute() call got, EXECUTION = which call it was (1, 2, ...), POSITION = the request's
place in the call. A request with the parameter "fail" gets an error response of its
own (the others in its call do not). A request whose parameters name FIFOs ("started",
"go") holds the instance: execute writes a line to "started", then waits for a line on
"go"."""

import json

import numpy as np
import triton_python_backend_utils as pb_utils


def _hold(request):
    params = json.loads(request.parameters())
    if "started" in params:
        with open(params["started"], "w") as fifo:
            fifo.write("started\n")
        with open(params["go"]) as fifo:
            fifo.readline()  # the test says go


class TritonPythonModel:
    def initialize(self, args):
        self.executions = 0

    def execute(self, requests):
        self.executions += 1
        for request in requests:
            _hold(request)
        responses = []
        for position, request in enumerate(requests):
            if "fail" in json.loads(request.parameters()):
                error = pb_utils.TritonError(f"request {position} failed on purpose")
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            data = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            shape = data.shape

            def full(value, shape=shape):
                return np.full(shape, value, dtype=np.int32)

            outputs = [
                pb_utils.Tensor("OUTPUT0", data * 2),
                pb_utils.Tensor("BATCH", full(len(requests))),
                pb_utils.Tensor("EXECUTION", full(self.executions)),
                pb_utils.Tensor("POSITION", full(position)),
            ]
            responses.append(pb_utils.InferenceResponse(outputs))
        return responses
