"""bls_pipeline: calls other models (BLS); the request parameter "mode" picks the calls.

sync / async       OUTPUT0 = async_execute(double(x)) = 2x + 1, OUTPUT1 = double(x)
                   (sync passes double's output on as it is, async passes a new array)
gather             double(x) and async_execute(x) at once: OUTPUT0 = 2x, OUTPUT1 = x + 1
decoupled[_async]  repeat(COUNT=len(x)): OUTPUT0 = the INDEX values, OUTPUT1 = [responses]
in_place           in_place(its own INPUT0): OUTPUT0 = INPUT0 read afterwards, OUTPUT1 =
                   what in_place returned (the same when the callee wrote into our memory)
error / missing    calls "raises" / a model that does not exist; answers with that error
timeout            gated(CONTROL, x) with a 0.2 s timeout; answers with the error
itself / bounce    calls itself / bls_bounce, which calls bls_pipeline: a circular call
ready              OUTPUT1 = [is_model_ready("double"), is_model_ready("no_such_model")]
reload             unload_model / load_model("double"): OUTPUT1 = readiness before, between,
                   after; OUTPUT0 = double(x) (explicit model control only)
sent               load_model("tripled", config, files) from files it sends, calls it, then
                   unload_model: OUTPUT0 = tripled(x) = 3x, OUTPUT1 = readiness before,
                   loaded, unloaded (explicit model control only)
"""

import asyncio
import json

import numpy as np
import triton_python_backend_utils as pb_utils


def request_for(model, inputs, **kwargs):
    names = ["OUTPUT0"] if model not in ("repeat", "bls_pipeline") else []
    return pb_utils.InferenceRequest(
        model_name=model, inputs=inputs, requested_output_names=names, **kwargs
    )


TRIPLED = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor(
                "OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy() * 3
            )])
            for r in requests
        ]
"""
TRIPLED_CONFIG = {
    "name": "tripled",
    "backend": "python",
    "max_batch_size": 0,
    "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [-1]}],
    "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [-1]}],
}


def output(response, name="OUTPUT0"):
    if response.has_error():
        raise CalleeFailed(response.error())
    return pb_utils.get_output_tensor_by_name(response, name).as_numpy()


class CalleeFailed(Exception):
    def __init__(self, error):
        super().__init__(error.message())
        self.error = error


class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            mode = json.loads(request.parameters()).get("mode", "sync")
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            try:
                call = getattr(self, "async_" if mode == "async" else mode)
                first, second = await call(request, x)
            except CalleeFailed as failed:
                responses.append(pb_utils.InferenceResponse(error=failed.error))
                continue
            outputs = [
                pb_utils.Tensor("OUTPUT0", np.asarray(first, dtype=np.float32)),
                pb_utils.Tensor("OUTPUT1", np.asarray(second, dtype=np.float32)),
            ]
            responses.append(pb_utils.InferenceResponse(outputs))
        return responses

    async def sync(self, request, x):
        doubled = output(request_for("double", [x]).exec())
        tensor = pb_utils.Tensor("INPUT0", doubled)
        return output(request_for("async_execute", [tensor]).exec()), doubled

    async def async_(self, request, x):
        doubled = output(await request_for("double", [x]).async_exec())
        # a new array (not a view of double's output): copied once into shared memory
        tensor = pb_utils.Tensor("INPUT0", doubled.copy())
        return output(await request_for("async_execute", [tensor]).async_exec()), doubled

    async def gather(self, request, x):
        doubled, plus_one = await asyncio.gather(
            request_for("double", [x]).async_exec(),
            request_for("async_execute", [x]).async_exec(),
        )
        return output(doubled), output(plus_one)

    async def decoupled(self, request, x):
        return self.collect(self.repeat_request(x).exec(decoupled=True))

    async def decoupled_async(self, request, x):
        return self.collect(await self.repeat_request(x).async_exec(decoupled=True))

    def repeat_request(self, x):
        count = pb_utils.Tensor("COUNT", np.array([x.as_numpy().size], dtype=np.int32))
        return request_for("repeat", [count])

    def collect(self, responses):
        indices, received = [], 0
        for response in responses:
            received += 1
            if response.output_tensors():  # the last one is empty: the final flag
                indices.append(int(output(response, "INDEX")[0]))
        return indices, [received]

    async def in_place(self, request, x):
        returned = output(request_for("in_place", [x]).exec())
        return x.as_numpy(), returned

    async def error(self, request, x):
        return output(request_for("raises", [x]).exec()), []

    async def missing(self, request, x):
        return output(request_for("no_such_model", [x]).exec()), []

    async def timeout(self, request, x):
        control = pb_utils.get_input_tensor_by_name(request, "CONTROL")
        data = pb_utils.Tensor("DATA", x.as_numpy())
        call = request_for("gated", [control, data], timeout=200_000)  # microseconds
        return output(call.exec()), []

    async def itself(self, request, x):
        params = {"mode": "sync"}
        return output(request_for("bls_pipeline", [x], parameters=params).exec()), []

    async def bounce(self, request, x):
        return output(request_for("bls_bounce", [x]).exec()), []

    async def reload(self, request, x):
        """Needs --model-control-mode explicit: unload double, then load it again."""
        states = [pb_utils.is_model_ready("double")]
        pb_utils.unload_model("double")
        states.append(pb_utils.is_model_ready("double"))
        pb_utils.load_model("double")
        states.append(pb_utils.is_model_ready("double"))
        return output(request_for("double", [x]).exec()), states

    async def sent(self, request, x):
        """Needs --model-control-mode explicit: a model made of files this model sends."""
        states = [pb_utils.is_model_ready("tripled")]
        pb_utils.load_model(
            "tripled",
            config=json.dumps(TRIPLED_CONFIG),
            files={"file:1/model.py": TRIPLED.encode()},
        )
        states.append(pb_utils.is_model_ready("tripled"))
        result = output(request_for("tripled", [x]).exec())
        pb_utils.unload_model("tripled")
        states.append(pb_utils.is_model_ready("tripled"))
        return result, states

    async def ready(self, request, x):
        found = [pb_utils.is_model_ready("double"), pb_utils.is_model_ready("no_such_model")]
        return x.as_numpy(), found
