"""init_exit: sys.exit(3) in initialize."""

import sys


class TritonPythonModel:
    def initialize(self, args):
        sys.exit(3)

    def execute(self, requests):
        raise AssertionError("never initialized")
