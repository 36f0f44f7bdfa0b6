"""siblings: a version folder of several files; FACTS: the JSON of how they were imported."""

import json
import sys

import helper as absolute_helper
import numpy as np
import triton_python_backend_utils as pb_utils

from . import helper
from .tools import scale


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            data = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            facts = {
                "name": __name__,
                "package": __package__,
                "helper": helper.__name__,
                "absolute_helper": absolute_helper.__name__,
                "tools": scale.__module__,
                "scaled": scale(helper.offset(data)).tolist(),
                "path_tail": sys.path[-2:],
            }
            output = np.array([json.dumps(facts).encode()], dtype=np.object_)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("FACTS", output)]))
        return responses
