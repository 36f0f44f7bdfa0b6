"""default_sender: a model that is not decoupled answering through its response senders.

Request parameters: ``mode`` (what to do, below), ``gate`` (a FIFO a late answer waits on:
a line written to it lets it go), ``started`` (a FIFO execute writes a line to before it
starts the late answer's thread), ``note`` (a file where the model writes the message of
an exception its sender raised, one line each).
"""

import json
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def response(request, which):
    value = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy() * 10 + which
    return pb_utils.InferenceResponse([pb_utils.Tensor("OUT", value.astype(np.int32))])


def noted(params, action):
    """Run ``action``; write the message of what it raised to the note file, and raise it."""
    try:
        action()
    except pb_utils.TritonModelException as exc:
        with open(params["note"], "a") as note:
            note.write(f"{exc}\n")
        raise


def later(params, action):
    """Run ``action`` in a thread, once the gate opens (if the request names one)."""
    if "started" in params:  # the test's cue that this execute is under way
        with open(params["started"], "w") as started:
            started.write("started\n")

    def run():
        if "gate" in params:
            with open(params["gate"]) as gate:
                gate.readline()
        action()

    threading.Thread(target=run, daemon=True).start()


class TritonPythonModel:
    def execute(self, requests):
        returned = [self._one(request) for request in requests]
        return None if all(r is None for r in returned) else returned

    def _one(self, request):
        params = json.loads(request.parameters())
        mode = params.get("mode", "return")
        if mode == "return":
            return response(request, 3)
        if mode == "nothing":
            return None
        sender = request.get_response_sender()
        if mode == "send":
            sender.send(response(request, 1), flags=FINAL)
        elif mode == "send_then_final":
            sender.send(response(request, 1))
            sender.send(flags=FINAL)
        elif mode == "send_without_final":
            sender.send(response(request, 1))
        elif mode == "final_first":
            sender.send(flags=FINAL)
        elif mode == "final_first_caught":
            try:
                sender.send(flags=FINAL)
            except pb_utils.TritonModelException:
                pass  # the model carries on, and returns None in the request's place
            return None
        elif mode == "twice":
            sender.send(response(request, 1))
            noted(params, lambda: sender.send(response(request, 2), flags=FINAL))
        elif mode == "send_and_return":
            sender.send(response(request, 1))
            return response(request, 3)
        elif mode == "later":
            later(params, lambda: sender.send(response(request, 1), flags=FINAL))
        elif mode == "later_then_final":
            later(params, lambda: (sender.send(response(request, 1)), sender.send(flags=FINAL)))
        elif mode == "final_first_later":
            later(params, lambda: noted(params, lambda: sender.send(flags=FINAL)))
        elif mode == "twice_later":
            later(
                params,
                lambda: (
                    sender.send(response(request, 1)),
                    noted(params, lambda: sender.send(response(request, 2))),
                ),
            )
        elif mode == "return_and_send_later":
            later(params, lambda: noted(params, lambda: sender.send(response(request, 1))))
            return response(request, 3)
        elif mode == "drop_later":  # the thread ends without sending: the sender is released
            later(params, lambda kept=sender: None)
        elif mode == "drop":  # taken and let go: nothing will answer
            pass
        else:
            raise ValueError(f"unknown mode {mode!r}")
        return None
