"""generation: OUTPUT0 = INPUT0, GENERATION = the config's "generation" parameter. The
config's "started" and "go" parameters (FIFOs) hold initialize until the test lets it
go on; "fail" makes it raise."""

import json

import numpy as np
import triton_python_backend_utils as pb_utils


def _parameter(config, key):
    found = config.get("parameters", {}).get(key)
    return None if found is None else found["string_value"]


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.generation = _parameter(config, "generation")
        started, go = _parameter(config, "started"), _parameter(config, "go")
        if started is not None:
            with open(started, "w") as fifo:
                fifo.write("started\n")
            with open(go) as fifo:
                fifo.readline()  # the test says go
        if _parameter(config, "fail") is not None:
            raise pb_utils.TritonModelException(f"generation {self.generation} fails to start")

    def execute(self, requests):
        generation = np.array([self.generation], dtype=np.object_)
        return [
            pb_utils.InferenceResponse(
                [
                    pb_utils.Tensor(
                        "OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
                    ),
                    pb_utils.Tensor("GENERATION", generation),
                ]
            )
            for r in requests
        ]
