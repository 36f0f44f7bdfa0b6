"""pb_arguments: one pb_utils call whose C++-string argument is VALUE (a BYTES input),
passed as the request parameter "kind" says: "str" (decoded), "bytes" (as it comes) or
"wrong" (the number 5). The parameter "case" names the call (CASES below). RESULT is
"ok: <what the call returned>" or "<exception type>: <its message>"; OUTPUT0 is INPUT0,
made by the call itself where the argument names it (a Tensor, an output buffer). The
"TritonError(message)" case answers with that error instead."""

import asyncio
import json

import numpy as np
import triton_python_backend_utils as pb_utils

PLAIN_CONFIG = json.dumps({
    "backend": "python", "max_batch_size": 0,
    "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [-1]}],
    "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [-1]}],
})  # fmt: skip


def bls(x, **names):
    arguments = {"model_name": "double", "requested_output_names": ["OUTPUT0"], **names}
    return pb_utils.InferenceRequest(inputs=[pb_utils.Tensor("INPUT0", x)], **arguments)


def doubled(response):
    if response.has_error():
        raise pb_utils.TritonModelException(response.error().message())
    return pb_utils.get_output_tensor_by_name(response, "OUTPUT0").as_numpy().tolist()


def reloaded(value):
    pb_utils.unload_model(value)
    before = pb_utils.is_model_ready("plain")
    pb_utils.load_model("plain")
    return before, pb_utils.is_model_ready("plain")


def counted(family):
    """How much an increment of 2 moved the family's metric (2.0)."""
    metric = family.Metric(labels={"case": "argument"})
    before = metric.value()
    metric.increment(2)
    return metric.value() - before


CASES = {
    "InferenceRequest(model_name).exec": lambda v, x, r: doubled(bls(x, model_name=v).exec()),
    "InferenceRequest(model_name).async_exec": lambda v, x, r: doubled(
        asyncio.run(bls(x, model_name=v).async_exec())
    ),
    "InferenceRequest(requested_output_names).exec": lambda v, x, r: doubled(
        bls(x, requested_output_names=[v]).exec()
    ),
    "InferenceRequest(request_id).exec": lambda v, x, r: doubled(bls(x, request_id=v).exec()),
    "is_model_ready(model_name)": lambda v, x, r: pb_utils.is_model_ready(v),
    "is_model_ready(model_version)": lambda v, x, r: pb_utils.is_model_ready("double", v),
    "load_model(model_name)": lambda v, x, r: (
        pb_utils.load_model(v),
        pb_utils.is_model_ready("plain"),
    ),
    "load_model(config)": lambda v, x, r: (
        pb_utils.load_model("plain", config=v),
        pb_utils.is_model_ready("plain"),
    ),
    "unload_model(model_name)": lambda v, x, r: reloaded(v),
    "MetricFamily(name)": lambda v, x, r: counted(
        pb_utils.MetricFamily(v, "a family", pb_utils.MetricFamily.COUNTER)
    ),
    "MetricFamily(description)": lambda v, x, r: counted(
        pb_utils.MetricFamily("pb_arguments_described", v, pb_utils.MetricFamily.COUNTER)
    ),
    "Tensor(name)": lambda v, x, r: pb_utils.Tensor(v, x),
    "Tensor.from_dlpack(name)": lambda v, x, r: pb_utils.Tensor.from_dlpack(v, x),
    "get_output_buffer(name)": lambda v, x, r: filled(
        pb_utils.get_output_buffer(r, v, x.shape, "FP32"), x
    ),
    "Logger.log_info(message)": lambda v, x, r: pb_utils.Logger.log_info(v),
    "TritonError(message)": lambda v, x, r: pb_utils.TritonError(v),
}


def filled(buffer, x):
    buffer.as_numpy()[:] = x
    return buffer


class TritonPythonModel:
    def execute(self, requests):
        return [self.one(request) for request in requests]

    def one(self, request):
        params = json.loads(request.parameters())
        x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
        raw = pb_utils.get_input_tensor_by_name(request, "VALUE").as_numpy()[0]
        value = {"str": raw.decode(), "bytes": raw, "wrong": 5}[params["kind"]]
        output = pb_utils.Tensor("OUTPUT0", x)
        try:
            result = CASES[params["case"]](value, x, request)
        except Exception as exc:  # what the model would see
            text = f"{type(exc).__name__}: {exc}"
        else:
            if isinstance(result, pb_utils.TritonError):
                return pb_utils.InferenceResponse(error=result)
            if isinstance(result, pb_utils.Tensor):
                output, result = result, result.name()
            text = f"ok: {result!r}"
        outputs = [output, pb_utils.Tensor("RESULT", np.array([text.encode()], dtype=np.object_))]
        return pb_utils.InferenceResponse(outputs)
