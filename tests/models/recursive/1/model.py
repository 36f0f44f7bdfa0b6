"""recursive: a model that calls itself with a counter that ends the recursion.

With DEPTH = n > 0 it adds "bool_n", "int_n" and "str_n" to the request's parameters and
calls itself with DEPTH = n - 1 and those parameters; with DEPTH = 0 it answers with the
parameters it received, as JSON (PARAMETERS). A callee's error is its answer. The
parameter "via" = "async_exec" makes every call with async_exec instead of exec, and
"call_timeout" gives every call that timeout (so they go through the server).

With the parameters "started", "go" and "done" (FIFOs, not passed on) it recurses once,
writes "started", waits for a line on "go", recurses again and writes "done": the test
stops the server meanwhile, so the second recursion shows its calls need no server.
"""

import asyncio
import json

import numpy as np
import triton_python_backend_utils as pb_utils

GATE = ("started", "go", "done")


def line(path, text=None):
    if text is None:
        with open(path) as fifo:
            return fifo.readline()
    with open(path, "w") as fifo:
        fifo.write(text)
    return text


class TritonPythonModel:
    def execute(self, requests):
        return [self.answer(request) for request in requests]

    def answer(self, request):
        params = json.loads(request.parameters())
        depth = int(pb_utils.get_input_tensor_by_name(request, "DEPTH").as_numpy()[0])
        gate = {key: params.pop(key) for key in GATE if key in params}
        if not gate:
            return self.recurse(depth, params)
        self.recurse(depth, params)  # every instance on the way opens its connections
        line(gate["started"], "started\n")
        line(gate["go"])
        response = self.recurse(depth, params)
        line(gate["done"], "done\n")
        return response

    def recurse(self, depth, params):
        if depth == 0:
            text = np.array([json.dumps(params)], dtype=np.object_)
            return pb_utils.InferenceResponse([pb_utils.Tensor("PARAMETERS", text)])
        params = dict(params)
        params[f"bool_{depth}"] = bool(depth)
        params[f"int_{depth}"] = depth
        params[f"str_{depth}"] = str(depth)
        request = pb_utils.InferenceRequest(
            model_name="recursive",
            inputs=[pb_utils.Tensor("DEPTH", np.array([depth - 1], dtype=np.uint8))],
            requested_output_names=["PARAMETERS"],
            parameters=params,
            timeout=int(params.get("call_timeout", 0)),
        )
        if params.get("via") == "async_exec":
            response = asyncio.run(request.async_exec())
        else:
            response = request.exec()
        if response.has_error():
            return pb_utils.InferenceResponse(error=response.error())
        return pb_utils.InferenceResponse(response.output_tensors())
