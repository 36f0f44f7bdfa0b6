"""flood_caller: a BLS caller that iterates over a decoupled callee only when told to."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [self._one(request) for request in requests]

    def _call(self, request, suffix="", parameters=None):
        count = pb_utils.get_input_tensor_by_name(request, "COUNT")
        size = pb_utils.get_input_tensor_by_name(request, "SIZE")
        call = pb_utils.InferenceRequest(
            model_name="flood",
            inputs=[
                pb_utils.Tensor("COUNT", count.as_numpy()),
                pb_utils.Tensor("SIZE", size.as_numpy()),
            ],
            requested_output_names=["OUTPUT0", "INDEX"],
            request_id="bls-" + request.request_id() + suffix,
            parameters=parameters or {},
        )
        return call.exec(decoupled=True)

    def _one(self, request):
        size = pb_utils.get_input_tensor_by_name(request, "SIZE")
        if pb_utils.get_input_tensor_by_name(request, "REVERSE") is not None:
            inline = {"inline": True}  # flood's instance is busy until a call has sent all
            first, second = self._call(request, "-1", inline), self._call(request, "-2", inline)
            received, intact = _read(second, int(size.as_numpy()[0]))
            more, intact_too = _read(first, int(size.as_numpy()[0]))
            return _result(received + more, intact and intact_too)
        responses = self._call(request)
        take = pb_utils.get_input_tensor_by_name(request, "TAKE")
        if take is not None:
            return self._take_then_cancel(responses, int(take.as_numpy()[0]))
        called, go = pb_utils.get_input_tensor_by_name(request, "CONTROL").as_numpy()
        with open(called.decode(), "w") as fifo:
            fifo.write("called\n")
        with open(go.decode()) as fifo:
            fifo.readline()  # the test says go
        return _result(*_read(responses, int(size.as_numpy()[0])))

    def _take_then_cancel(self, responses, take):
        received = 0
        for response in responses:
            if not response.has_error():
                received += 1
            if received == take:
                break
        responses.cancel()
        return pb_utils.InferenceResponse(
            [
                pb_utils.Tensor("RECEIVED", np.array([received], dtype=np.int32)),
                pb_utils.Tensor("INTACT", np.array([1], dtype=np.int32)),
            ]
        )


def _read(responses, expected_size):
    """How many responses came, and whether each was intact and in order."""
    received, intact = 0, True
    for response in responses:
        if response.has_error():
            intact = False
            continue
        index = pb_utils.get_output_tensor_by_name(response, "INDEX")
        if index is None:  # the empty final response
            continue
        data = pb_utils.get_output_tensor_by_name(response, "OUTPUT0").as_numpy()
        intact = intact and int(index.as_numpy()[0]) == received
        intact = intact and data.size == expected_size and bool(np.all(data == received % 256))
        received += 1
    return received, intact


def _result(received, intact):
    return pb_utils.InferenceResponse(
        [
            pb_utils.Tensor("RECEIVED", np.array([received], dtype=np.int32)),
            pb_utils.Tensor("INTACT", np.array([int(intact)], dtype=np.int32)),
        ]
    )
