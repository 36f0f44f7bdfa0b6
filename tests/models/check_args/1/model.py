"""check_args: checks the keys of initialize's args and hands them back."""

import json

import numpy as np
import triton_python_backend_utils as pb_utils

EXPECTED = {
    "model_config",
    "model_instance_kind",
    "model_instance_name",
    "model_instance_device_id",
    "model_repository",
    "model_version",
    "model_name",
}


class TritonPythonModel:
    def initialize(self, args):
        missing = EXPECTED - set(args)
        if missing:
            raise KeyError(f"initialize args lack {sorted(missing)}")
        if not all(isinstance(v, str) for v in args.values()):
            raise TypeError("every initialize arg must be a str")
        self.args = dict(args)
        pb_utils.Logger.log_info(f"check_args initialized instance {args['model_instance_name']}")

    def execute(self, requests):
        text = json.dumps(self.args).encode()
        out = pb_utils.Tensor("ARGS", np.array([text], dtype=np.object_))
        return [pb_utils.InferenceResponse([out]) for _ in requests]
