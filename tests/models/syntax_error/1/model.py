"""syntax_error: this file does not compile (line 5)."""


class TritonPythonModel:
    def execute(self, requests)
        return []
