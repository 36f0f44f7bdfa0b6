"""argv_probe: what a model sees of the command line, as Triton's own test models use it.

initialize and execute parse the command line with argparse (a model's own options would
come from it); execute runs a unittest suite the way Triton's QA models do
(``unittest.main("model", exit=False)``). FACTS: the JSON of what they saw.
"""

import argparse
import json
import sys
import unittest

import numpy as np
import triton_python_backend_utils as pb_utils


def parse() -> str:
    parser = argparse.ArgumentParser()
    parser.add_argument("--verbose", action="store_true")
    return repr(parser.parse_args())


class InsideExecute(unittest.TestCase):
    def test_arithmetic(self):
        self.assertEqual(1 + 1, 2)


class TritonPythonModel:
    def initialize(self, args):
        self.at_initialize = parse()

    def execute(self, requests):
        result = unittest.main("model", exit=False, verbosity=0)
        facts = {
            "argv": sys.argv,
            "initialize": self.at_initialize,
            "execute": parse(),
            "tests_run": result.result.testsRun,
            "passed": result.result.wasSuccessful(),
        }
        output = np.array([json.dumps(facts).encode()], dtype=np.object_)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("FACTS", output)]) for _ in requests]
