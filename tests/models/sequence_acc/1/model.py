"""A stateful accumulator that relies on Triton's sequence batcher, as such models do:
each instance keeps ONE running sum (no table by id), reset when the START control
input is 1, so a sequence gets its own sum only if all its requests reach the instance
its START went to. Reports what it saw: SUM, the instance's PID, the control inputs
(START, END, READY, CORRID when the config has them), request.correlation_id() (as its
repr, so an int and a str differ), request.flags(), and request.parameters().

A request whose parameters name FIFOs ("started", "go") holds the instance: execute
writes a line to "started", then waits for a line on "go"."""

import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils


def _hold(request):
    params = json.loads(request.parameters())
    if "started" in params:
        with open(params["started"], "w") as fifo:
            fifo.write("started\n")
        with open(params["go"]) as fifo:
            fifo.readline()


def _control(request, name, dtype):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return np.zeros(1, dtype)
    return tensor.as_numpy().reshape(1).astype(dtype)


def _text(value):
    """CORRID as text: a BYTES id decoded, an integer id as its decimal digits."""
    return value.decode() if isinstance(value, bytes) else str(int(value))


class TritonPythonModel:
    def initialize(self, args):
        self.sum = 0

    def execute(self, requests):
        responses = []
        for request in requests:
            _hold(request)
            start = _control(request, "START", np.int32)
            if start[0] == 1:
                self.sum = 0
            value = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()
            shape = value.shape  # [1], or [1, 1] with max_batch_size > 0
            self.sum += int(value.reshape(-1)[0])
            corrid = pb_utils.get_input_tensor_by_name(request, "CORRID")
            corrid_seen = corrid.as_numpy().reshape(1) if corrid is not None else np.zeros(1)
            seen = {
                "SUM": np.array([self.sum], np.int32),
                "PID": np.array([os.getpid()], np.int64),
                "START": start,
                "END": _control(request, "END", np.float32),
                "READY": _control(request, "READY", np.bool_),
                "CORRID": np.array([_text(corrid_seen[0])], np.object_),
                "ID": np.array([repr(request.correlation_id())], np.object_),
                "FLAGS": np.array([request.flags()], np.int32),
                "PARAMS": np.array([request.parameters()], np.object_),
            }
            outputs = [pb_utils.Tensor(k, v.reshape(shape)) for k, v in seen.items()]
            responses.append(pb_utils.InferenceResponse(outputs))
        return responses
