"""raises: execute raises a ValueError whose message the tests check."""


class TritonPythonModel:
    def execute(self, requests):
        raise ValueError("raises: execute failed on purpose")
