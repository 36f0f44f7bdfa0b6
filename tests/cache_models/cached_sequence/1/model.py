"""cached_sequence: never loads (the sequence batcher with the response cache)."""


class TritonPythonModel:
    def execute(self, requests):
        return None
