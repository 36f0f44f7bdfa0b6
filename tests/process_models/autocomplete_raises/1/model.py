"""autocomplete_raises: auto_complete_config raises a ValueError."""


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        raise ValueError("autocomplete_raises: no config on purpose")

    def execute(self, requests):
        raise AssertionError("never loaded")
