"""bls_report: BLS calls as Triton's documentation describes them; REPORT is a JSON
object of what they gave. The request parameter "mode" picks the calls, and "via"
("exec", the default, or "async_exec") how they are made:

timeout       timeout_echo with timeout=<parameter "call_timeout"> (microseconds): {"timeout":
              what the callee read from request.timeout()} or {"error": its message}
iterate       repeat (decoupled) with COUNT=<parameter "count">, one response iterator
              walked as Triton's tests walk it: {"first": INDEX of next(), "rest": INDEXes
              of a for loop after it, "again": responses of a second and third for loop,
              "partial": responses of a loop left after 2, "resumed": responses of the loop
              after it and one next(), "exhausted": whether next() then stops}
wrong_inputs  add_sub with 1 input of the wrong type, with 2 inputs one of the wrong type,
              and repeat with none: {"count", "dtype", "decoupled": their error messages}
not_ready     a model that does not exist, a version that does not, and the first again
              with decoupled=True: {"model", "version", "decoupled": their messages}
recursive     recursive with DEPTH=<parameter "depth"> and the parameter "call_timeout"
              passed on: what it answered ({"PARAMETERS": ...}) or {"error": its message}
fork          one call in each of 2 processes forked by multiprocessing.Pool: {"error":
              what the forked processes raised, "terminable": whether SIGTERM ends such a
              process (Pool.terminate needs it), "after": double(1) from this process}
"""

import asyncio
import json
import multiprocessing
import signal

import numpy as np
import triton_python_backend_utils as pb_utils


def report(value):
    text = np.array([json.dumps(value)], dtype=np.object_)
    return pb_utils.InferenceResponse([pb_utils.Tensor("REPORT", text)])


def call(request, via, decoupled=False):
    if via == "async_exec":
        return asyncio.run(_awaited(request, decoupled))
    return request.exec(decoupled=decoupled)


async def _awaited(request, decoupled):
    return await request.async_exec(decoupled=decoupled)


def index(response):
    """A repeat response's INDEX; None for the bare final one."""
    if response.has_error():
        raise pb_utils.TritonModelException(response.error().message())
    outputs = response.output_tensors()
    return int(outputs[0].as_numpy()[0]) if outputs else None


def message(response):
    return response.error().message() if response.has_error() else None


def fp(name, dtype, count=4):
    return pb_utils.Tensor(name, np.ones(count, dtype=dtype))


def double_one(_=None):
    """One call to double, as a forked process makes it."""
    request = pb_utils.InferenceRequest(
        model_name="double",
        inputs=[fp("INPUT0", np.float32, 1)],
        requested_output_names=["OUTPUT0"],
    )
    response = request.exec()
    if response.has_error():
        raise RuntimeError(response.error().message())
    return float(pb_utils.get_output_tensor_by_name(response, "OUTPUT0").as_numpy()[0])


def terminable(_=None):
    return signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            params = json.loads(request.parameters())
            mode = getattr(self, params["mode"])
            responses.append(report(mode(params, params.get("via", "exec"))))
        return responses

    def timeout(self, params, via):
        request = pb_utils.InferenceRequest(
            model_name="timeout_echo",
            inputs=[pb_utils.Tensor("INPUT0", np.ones((1, 1), dtype=np.float32))],
            requested_output_names=["TIMEOUT"],
            timeout=int(params["call_timeout"]),
        )
        response = call(request, via)
        if response.has_error():
            return {"error": message(response)}
        seen = pb_utils.get_output_tensor_by_name(response, "TIMEOUT").as_numpy()
        return {"timeout": int(seen[0][0])}

    def iterate(self, params, via):
        count = np.array([int(params["count"])], dtype=np.int32)
        request = pb_utils.InferenceRequest(
            model_name="repeat",
            inputs=[pb_utils.Tensor("COUNT", count)],
            requested_output_names=["INDEX"],
        )
        responses = call(request, via, decoupled=True)
        found = {"first": index(next(responses))}
        found["rest"] = [index(response) for response in responses]
        found["again"] = [len(list(responses)), len(list(responses))]
        partial = 0
        for _ in responses:
            partial += 1
            if partial == 2:
                break
        found["partial"] = partial
        next(responses)
        found["resumed"] = len(list(responses))
        try:
            next(responses)
            found["exhausted"] = False
        except StopIteration:
            found["exhausted"] = True
        return found

    def wrong_inputs(self, params, via):
        def add_sub(*inputs):
            request = pb_utils.InferenceRequest(
                model_name="add_sub",
                inputs=list(inputs),
                requested_output_names=["OUTPUT0", "OUTPUT1"],
            )
            return message(call(request, via))

        none = pb_utils.InferenceRequest(
            model_name="repeat", inputs=[], requested_output_names=["INDEX"]
        )
        return {
            "count": add_sub(fp("INPUT0", np.float64)),
            "dtype": add_sub(fp("INPUT0", np.float32), fp("INPUT1", np.float64)),
            "decoupled": [message(r) for r in call(none, via, decoupled=True)],
        }

    def not_ready(self, params, via):
        def request(model, **kwargs):
            return pb_utils.InferenceRequest(
                model_name=model,
                inputs=[fp("INPUT0", np.float32)],
                requested_output_names=["OUTPUT0"],
                **kwargs,
            )

        return {
            "model": message(call(request("no_such_model"), via)),
            "version": message(call(request("double", model_version=7), via)),
            "decoupled": [message(r) for r in call(request("no_such_model"), via, decoupled=True)],
        }

    def recursive(self, params, via):
        depth = np.array([int(params["depth"])], dtype=np.uint8)
        request = pb_utils.InferenceRequest(
            model_name="recursive",
            inputs=[pb_utils.Tensor("DEPTH", depth)],
            requested_output_names=["PARAMETERS"],
            parameters={"call_timeout": int(params["call_timeout"])},
        )
        response = call(request, via)
        if response.has_error():
            return {"error": message(response)}
        text = pb_utils.get_output_tensor_by_name(response, "PARAMETERS").as_numpy()[0]
        return {"PARAMETERS": json.loads(text)}

    def fork(self, params, via):
        with multiprocessing.get_context("fork").Pool(2) as pool:  # its end: terminate()
            try:
                pool.map(double_one, [1, 2])
                error = None
            except Exception as exc:
                error = str(exc)
            found = {"error": error, "terminable": pool.apply(terminable)}
        return {**found, "after": double_one()}
