"""bad_frame: frames that cannot be read, written on purpose through this worker's real
channels (the pb_utils checks would refuse such values, so they are made by hand). The
request parameter "mode":

ok              OUTPUT0 = INPUT0; PIDS = [this process, bad_callee's] (one call to it)
reply           this request's reply names OUTPUT0 with bytes (a private attribute set)
call            a BlsCall frame whose model name is bytes; ERROR = the server's answer
garbage         a frame whose header is not msgpack at all, then the reply as in "ok"
direct_reply    a call to bad_callee that makes its reply unreadable; ERROR = its error
                (the parameter "callee" may name bad_gpu_callee instead, for both calls)
direct_request  (direct calls only) an Infer frame with a bytes request id, straight on
                this worker's connection to bad_callee; ERROR = the callee's answer
raise           raises an exception whose message is not UTF-8 text (a lone surrogate)
unsendable      this request's reply names OUTPUT0 with such a text (a private attribute
                set): a frame that cannot even be encoded

Every mode but "reply" answers with OUTPUT0 = INPUT0, PIDS and ERROR ("" in "ok"), and
HELD: how many pieces of the output arenas of this worker and of bad_callee's were in use
when their executes began (outputs of replies not given back).
"""

import json
import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils

from dlserve.ipc import codec
from dlserve.ipc import messages as m
from dlserve.worker.link import link


def call_callee(x, callee="bad_callee"):
    request = pb_utils.InferenceRequest(
        model_name=callee,
        inputs=[pb_utils.Tensor("INPUT0", x)],
        requested_output_names=[],  # all: a bytes-named output is not left out
    )
    return request.exec()


def callee_state(x, callee):
    """The callee's process id, and the pieces of its output memory in use."""
    response = call_callee(np.abs(x), callee)
    if response.has_error():
        raise pb_utils.TritonModelException(response.error().message())
    pid, held = (pb_utils.get_output_tensor_by_name(response, name) for name in ("PID", "HELD"))
    return int(pid.as_numpy()[0]), int(held.as_numpy()[0])


def bad_call():
    """A BLS call whose model name is bytes, sent as pb_utils sends one."""
    worker = link.current()
    call = worker.next_call_id()
    worker.open_call(call)
    try:
        worker.send(m.BlsCall(call=call, model_name=b"double", inputs=[]))
        answer, _ = worker.wait_answer(call, time.monotonic() + 60)
    finally:
        worker.close_call(call)
    return answer.error


def garbage():
    worker = link.current()
    with worker._send_lock:
        worker._channel._sock.sendall(codec.PREFIX.pack(2, 0) + b"\xc1\xc1")
    return ""


def direct_request():
    worker = link.current()
    target = worker.direct.target("bad_callee", -1)
    conn = target.take(None, [])
    try:
        conn.channel.send(m.Infer(rid=-worker.next_call_id(), request_id=b"bytes id", inputs=[]))
        reply, _ = conn.channel.recv()
    finally:
        conn.busy.release()
    return reply.error


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        held = len(link.current().memory.output_arena._used)
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            params = json.loads(request.parameters())
            mode, callee = params["mode"], params.get("callee", "bad_callee")
            error = ""
            if mode == "call":
                error = bad_call()
            elif mode == "garbage":
                error = garbage()
            elif mode == "direct_reply":
                error = call_callee(-np.abs(x) - 1, callee).error().message()
            elif mode == "direct_request":
                error = direct_request()
            if mode == "raise":
                raise pb_utils.TritonModelException("no \udc80 text")
            output = pb_utils.Tensor("OUTPUT0", x)
            if mode == "reply":
                output._name = b"OUTPUT0"
            elif mode == "unsendable":
                output._name = "OUTPUT0 \udc80"
            callee_pid, callee_held = callee_state(x[:1], callee)
            pids = np.array([os.getpid(), callee_pid], dtype=np.int64)
            responses.append(
                pb_utils.InferenceResponse(
                    [
                        output,
                        pb_utils.Tensor("PIDS", pids),
                        pb_utils.Tensor("ERROR", np.array([error.encode()], dtype=np.object_)),
                        pb_utils.Tensor("HELD", np.array([held, callee_held], dtype=np.int64)),
                    ]
                )
            )
        return responses
