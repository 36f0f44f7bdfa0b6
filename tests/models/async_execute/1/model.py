"""async_execute: an ``async def execute`` model (Triton runs it in an event loop)."""

import asyncio

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            data = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            await asyncio.sleep(0)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", data + 1)]))
        return responses
