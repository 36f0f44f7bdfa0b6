"""bls_by_name: calls the model MODEL_NAME names (a BYTES input: ``as_numpy()[0]`` is a
``bytes`` object, passed on as it is, as Triton's BLS example does) with INPUT0, and
returns its OUTPUT0. The request parameter "mode":

sync    ``exec()``
async   ``await async_exec()``, two calls at once with ``asyncio.gather`` (OUTPUT0: the
        first's)
bytes   ``exec()`` with every name as bytes: request_id, requested_output_names, and
        the input Tensor's own name

DIRECT: whether this worker now holds a direct connection to a callee (dlserve's BLS
calls without the server; False with ``--bls-direct false``).
"""

import asyncio
import json

import numpy as np
import triton_python_backend_utils as pb_utils

from dlserve.worker.link import link


def bls_request(model_name, x, *, as_bytes=False):
    if as_bytes:
        return pb_utils.InferenceRequest(
            model_name=model_name,
            inputs=[pb_utils.Tensor(b"INPUT0", x.as_numpy())],
            requested_output_names=[b"OUTPUT0"],
            request_id=b"by-name",
        )
    return pb_utils.InferenceRequest(
        model_name=model_name, inputs=[x], requested_output_names=["OUTPUT0"]
    )


def output0(infer_response):
    if infer_response.has_error():
        raise pb_utils.TritonModelException(infer_response.error().message())
    return pb_utils.get_output_tensor_by_name(infer_response, "OUTPUT0").as_numpy()


class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            model_name = pb_utils.get_input_tensor_by_name(request, "MODEL_NAME")
            model_name_bytes = model_name.as_numpy()[0]
            assert isinstance(model_name_bytes, bytes), type(model_name_bytes)
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            mode = json.loads(request.parameters())["mode"]
            if mode == "sync":
                result = output0(bls_request(model_name_bytes, x).exec())
            elif mode == "async":
                first, second = await asyncio.gather(
                    bls_request(model_name_bytes, x).async_exec(),
                    bls_request(model_name_bytes, x).async_exec(),
                )
                result = output0(first)
                assert np.array_equal(result, output0(second))
            else:
                result = output0(bls_request(model_name_bytes, x, as_bytes=True).exec())
            direct = np.array([link.current().direct.active])
            responses.append(
                pb_utils.InferenceResponse(
                    [pb_utils.Tensor("OUTPUT0", result), pb_utils.Tensor("DIRECT", direct)]
                )
            )
        return responses
