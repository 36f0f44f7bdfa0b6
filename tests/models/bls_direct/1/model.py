"""bls_direct: BLS calls that go straight to a callee's instance, not through the server.
The request parameter "mode" says what it does:

stopped   one call to double(x) (the first call asks the server for the connection); then
          the FIFO handshake the parameters started / go / done name: writes "started",
          waits for a line on go, calls double(x) three times, writes "done". OUTPUT0 =
          the last result, OUTPUT1 = [calls made]. The test stops the server meanwhile.
calls     double(x), "count" times in a row: OUTPUT0 = the last result, OUTPUT1 = [count]
same      two calls to double(x) at once (asyncio.gather): OUTPUT0, OUTPUT1
crash     crash(x) (x holding -1 kills crash's instance): its error, or OUTPUT0 = crash(x)
in_place  in_place(x): OUTPUT0 = x read afterwards, OUTPUT1 = what in_place returned
invalid   double(x as INT32): the callee's checks refuse it; answers with that error
"""

import asyncio
import json

import numpy as np
import triton_python_backend_utils as pb_utils


def call(model, x):
    request = pb_utils.InferenceRequest(
        model_name=model, inputs=[x], requested_output_names=["OUTPUT0"]
    )
    return request


def result(response):
    if response.has_error():
        raise Failed(response.error())
    return pb_utils.get_output_tensor_by_name(response, "OUTPUT0").as_numpy()


class Failed(Exception):
    def __init__(self, error):
        super().__init__(error.message())
        self.error = error


def line(path, text=None):
    if text is None:
        with open(path) as fifo:
            return fifo.readline()
    with open(path, "w") as fifo:
        fifo.write(text)
    return text


class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            params = json.loads(request.parameters())
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            try:
                first, second = await getattr(self, params["mode"])(params, x)
            except Failed as failed:
                responses.append(pb_utils.InferenceResponse(error=failed.error))
                continue
            outputs = [
                pb_utils.Tensor("OUTPUT0", np.asarray(first, dtype=np.float32)),
                pb_utils.Tensor("OUTPUT1", np.asarray(second, dtype=np.float32)),
            ]
            responses.append(pb_utils.InferenceResponse(outputs))
        return responses

    async def stopped(self, params, x):
        result(call("double", x).exec())
        line(params["started"], "started\n")
        line(params["go"])
        for _ in range(3):
            last = result(call("double", x).exec())
        line(params["done"], "done\n")
        return last, [3]

    async def calls(self, params, x):
        for _ in range(int(params["count"])):
            last = result(call("double", x).exec())
        return last, [params["count"]]

    async def same(self, params, x):
        first, second = await asyncio.gather(
            call("double", x).async_exec(), call("double", x).async_exec()
        )
        return result(first), result(second)

    async def crash(self, params, x):
        return result(call("crash", x).exec()), []

    async def invalid(self, params, x):
        wrong = pb_utils.Tensor("INPUT0", x.as_numpy().astype(np.int32))
        return result(call("double", wrong).exec()), []

    async def in_place(self, params, x):
        returned = result(call("in_place", x).exec())
        return x.as_numpy(), returned
