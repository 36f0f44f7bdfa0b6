"""versioned, version 1: answers with its version number (from initialize's args)."""

import numpy as np
import triton_python_backend_utils as pb_utils

FILE_VERSION = 1


class TritonPythonModel:
    def initialize(self, args):
        self.version = int(args["model_version"])
        if self.version != FILE_VERSION:
            raise ValueError(f"version folder {FILE_VERSION} got version {self.version}")

    def execute(self, requests):
        out = np.array([self.version], dtype=np.int32)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", out)]) for _ in requests]
