"""repeat: a decoupled model (see config.pbtxt for what each parameter does)."""

import json
import os
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        self.cancelled = 0
        self.cancel_seen = threading.Event()
        self.threads = []

    def execute(self, requests):
        for request in requests:
            params = json.loads(request.parameters())
            if params.get("report"):
                self.report(request)
            elif params.get("until_cancelled"):
                self.start(self.until_cancelled, request)
            elif params.get("threaded"):
                self.start(self.respond, request, params)
            else:
                self.respond(request, params)
        return None

    def start(self, target, *args):
        thread = threading.Thread(target=target, args=args)
        thread.start()
        self.threads.append(thread)

    def respond(self, request, params):
        sender = request.get_response_sender()
        count = int(pb_utils.get_input_tensor_by_name(request, "COUNT").as_numpy()[0])
        for index in range(count):
            if index == params.get("crash_at"):
                os._exit(1)  # the worker dies in the middle of the stream
            if index == params.get("fail_at"):
                error = pb_utils.TritonError(f"repeat: response {index} failed on purpose")
                sender.send(pb_utils.InferenceResponse(error=error))
                continue
            output = pb_utils.Tensor("INDEX", np.array([index], dtype=np.int32))
            sender.send(pb_utils.InferenceResponse([output]))
        sender.send(flags=FINAL)

    def until_cancelled(self, request):
        sender = request.get_response_sender()
        index = 0
        while not request.is_cancelled():
            output = pb_utils.Tensor("INDEX", np.array([index], dtype=np.int32))
            sender.send(pb_utils.InferenceResponse([output]))
            index += 1
            time.sleep(0.01)  # the model's pace
        self.cancelled += 1
        self.cancel_seen.set()
        sender.send(flags=FINAL)

    def report(self, request):
        self.cancel_seen.wait(30)
        output = pb_utils.Tensor("INDEX", np.array([self.cancelled], dtype=np.int32))
        request.get_response_sender().send(pb_utils.InferenceResponse([output]), flags=FINAL)

    def finalize(self):
        for thread in self.threads:
            thread.join(5)
