"""execute_fails: execute fails as MODE says.

- b"helper": a numpy error two calls deep in helper.py;
- b"model_exception": raises pb_utils.TritonModelException;
- b"exit": sys.exit(4): an exception like any other, the instance lives on;
- anything else: OUTPUT0 = [1.0].
"""

import sys

import numpy as np
import triton_python_backend_utils as pb_utils

from . import helper


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            mode = pb_utils.get_input_tensor_by_name(request, "MODE").as_numpy()[0]
            if mode == b"helper":
                helper.work()
            if mode == b"model_exception":
                raise pb_utils.TritonModelException("execute_fails: on purpose")
            if mode == b"exit":
                sys.exit(4)
        output = pb_utils.Tensor("OUTPUT0", np.ones(1, dtype=np.float32))
        return [pb_utils.InferenceResponse([output]) for _ in requests]
