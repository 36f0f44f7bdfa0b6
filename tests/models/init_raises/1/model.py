"""init_raises: initialize raises (line 9); the load fails with the file and line."""

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        pb_utils.Logger.log_info("init_raises is about to fail")
        raise RuntimeError("init_raises: initialize failed on purpose")

    def execute(self, requests):
        raise AssertionError("never initialized")
