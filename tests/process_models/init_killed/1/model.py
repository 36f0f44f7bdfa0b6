"""init_killed: initialize kills its own process with SIGKILL."""

import os
import signal


class TritonPythonModel:
    def initialize(self, args):
        os.kill(os.getpid(), signal.SIGKILL)

    def execute(self, requests):
        raise AssertionError("never initialized")
