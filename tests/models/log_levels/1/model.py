"""log_levels: the log settings this worker holds, as its environment says."""

import os

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        settings = np.array(
            [os.environ.get("DLSERVE_LOG_VERBOSE", "0").encode(),
             os.environ.get("DLSERVE_LOG_LEVELS", "info,warning,error").encode(),
             os.environ.get("DLSERVE_LOG_FORMAT", "default").encode()],
            dtype=np.object_,
        )  # fmt: skip
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", settings)]) for _ in requests
        ]
