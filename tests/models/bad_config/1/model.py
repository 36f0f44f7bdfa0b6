"""bad_config: never loaded (its config.pbtxt is broken)."""


class TritonPythonModel:
    def execute(self, requests):
        raise AssertionError("bad_config must never be loaded")
