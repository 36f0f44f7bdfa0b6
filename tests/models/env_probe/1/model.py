"""env_probe: says which Python runs it (PREFIX: sys.prefix), what the environment's own
package says (MARKER: envprobe.VALUE, "" when there is none), and whether a package of the
server's environment (tritonclient) can be imported (SERVER_PACKAGE: "yes" / "no")."""

import importlib.util
import sys

import numpy as np
import triton_python_backend_utils as pb_utils


def _marker() -> str:
    try:
        import envprobe
    except ImportError:
        return ""
    return envprobe.VALUE


class TritonPythonModel:
    def initialize(self, args):
        self.values = {
            "PREFIX": sys.prefix,
            "MARKER": _marker(),
            "SERVER_PACKAGE": "yes" if importlib.util.find_spec("tritonclient") else "no",
        }

    def execute(self, requests):
        outputs = [
            pb_utils.Tensor(name, np.array([value.encode()], dtype=np.object_))
            for name, value in self.values.items()
        ]
        return [pb_utils.InferenceResponse(outputs) for _ in requests]
