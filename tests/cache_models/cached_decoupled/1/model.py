"""cached_decoupled: never loads (decoupled with the response cache)."""


class TritonPythonModel:
    def execute(self, requests):
        return None
