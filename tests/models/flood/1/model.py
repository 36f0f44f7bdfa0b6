"""flood: COUNT responses of SIZE bytes, sent from a thread as fast as send() returns.

The request's parameter "tag" (else its id) labels its gauges (flood_sent,
flood_cancelled, flood_done), so that a test can watch how far the model got while its
client reads slowly or not at all. With the parameter "inline" the responses are sent
from ``execute`` itself: the instance stays busy until the last one is sent.
"""

import json
import os
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        kind = pb_utils.MetricFamily.GAUGE
        self.sent = pb_utils.MetricFamily("flood_sent", "sends that returned", kind)
        self.cancelled = pb_utils.MetricFamily("flood_cancelled", "is_cancelled() seen", kind)
        self.done = pb_utils.MetricFamily("flood_done", "the final flag went out", kind)
        self.pid = pb_utils.MetricFamily("flood_pid", "the worker's process id", kind)
        self.threads = []

    def execute(self, requests):
        for request in requests:
            count = int(pb_utils.get_input_tensor_by_name(request, "COUNT").as_numpy()[0])
            size = int(pb_utils.get_input_tensor_by_name(request, "SIZE").as_numpy()[0])
            if json.loads(request.parameters() or "{}").get("inline"):
                self._flood(request, count, size)
                continue
            thread = threading.Thread(target=self._flood, args=(request, count, size))
            thread.start()
            self.threads.append(thread)
        return None

    def _flood(self, request, count, size):
        tag = json.loads(request.parameters() or "{}").get("tag", request.request_id())
        labels = {"request": str(tag)}
        sent = self.sent.Metric(labels=labels)
        cancelled = self.cancelled.Metric(labels=labels)
        done = self.done.Metric(labels=labels)
        self.pid.Metric(labels=labels).set(os.getpid())
        sender = request.get_response_sender()
        for index in range(count):
            if sender.is_cancelled():
                cancelled.set(1)
                break
            outputs = [
                pb_utils.Tensor("OUTPUT0", np.full(size, index % 256, dtype=np.uint8)),
                pb_utils.Tensor("INDEX", np.array([index], dtype=np.int32)),
            ]
            sender.send(pb_utils.InferenceResponse(outputs))
            sent.set(index + 1)
        if sender.is_cancelled():
            cancelled.set(1)
        sender.send(flags=FINAL)
        done.set(1)

    def finalize(self):
        for thread in self.threads:
            thread.join()
