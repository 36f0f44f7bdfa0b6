"""iterative_steps: a request (keyed by its id) is done after STEPS executes counted for
it (STEPS < 0: never); until then the model reschedules it and puts None in its place.
An execute counts for a request only when the batch holds at least the request's
``together`` parameter (default 1) requests, so a test can wait for two requests to share
executes without timing. COUNT: the executes counted; WIDEST: the largest batch it was in.
A request with an ``exit_at`` parameter ends the process at that execute (a crash).
DATA (optional): the model keeps the view it got at the request's first execute; SAME says
whether it still holds those bytes at the last one (a rescheduled request's inputs stay
where they are until it is done)."""

import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.counts = {}
        self.widest = {}
        self.first = {}  # key -> (the DATA view of the first execute, a copy of it)

    def execute(self, requests):
        responses = []
        for request in requests:
            key = request.request_id()
            steps = int(pb_utils.get_input_tensor_by_name(request, "STEPS").as_numpy().item())
            data = pb_utils.get_input_tensor_by_name(request, "DATA")
            if data is not None and key not in self.first:
                self.first[key] = (data.as_numpy(), data.as_numpy().copy())
            parameters = json.loads(request.parameters())
            together = parameters.get("together", 1)
            self.widest[key] = max(self.widest.get(key, 0), len(requests))
            if len(requests) >= together:
                self.counts[key] = self.counts.get(key, 0) + 1
            if "exit_at" in parameters and self.counts.get(key) == parameters["exit_at"]:
                os._exit(1)
            if steps < 0 or self.counts.get(key, 0) < steps:
                request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
                responses.append(None)
                continue
            count, widest = self.counts.pop(key), self.widest.pop(key)
            view, copy = self.first.pop(key, (None, None))
            same = view is None or bool(np.array_equal(view, copy))
            outputs = [
                pb_utils.Tensor("COUNT", np.array([[count]], np.int32)),
                pb_utils.Tensor("WIDEST", np.array([[widest]], np.int32)),
                pb_utils.Tensor("SAME", np.array([[same]], np.bool_)),
            ]
            responses.append(pb_utils.InferenceResponse(outputs))
        return responses
