"""custom_metrics: pb_utils.MetricFamily / Metric of the three kinds, updated per request."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        labels = {"model": args["model_name"], "version": args["model_version"]}
        self.requests = pb_utils.MetricFamily(
            name="test_custom_requests",
            description="Requests the custom_metrics model executed",
            kind=pb_utils.MetricFamily.COUNTER,
        ).Metric(labels=labels)
        self.last_sum = pb_utils.MetricFamily(
            name="test_custom_last_sum",
            description="Sum of the last request's INPUT0",
            kind=pb_utils.MetricFamily.GAUGE,
        ).Metric(labels=labels)
        self.sums = pb_utils.MetricFamily(
            name="test_custom_sum",
            description="Sums of INPUT0",
            kind=pb_utils.MetricFamily.HISTOGRAM,
        ).Metric(labels=labels, buckets=[1.0, 10.0, 100.0])

    def execute(self, requests):
        responses = []
        for request in requests:
            total = float(pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy().sum())
            self.requests.increment(1)
            self.last_sum.set(total)
            self.sums.observe(total)
            try:
                self.requests.increment(-1)
                refusal = "counter went down"
            except pb_utils.TritonModelException as exc:
                refusal = str(exc)
            outputs = [
                pb_utils.Tensor("OUTPUT0", np.array([self.requests.value()], dtype=np.float64)),
                pb_utils.Tensor("OUTPUT1", np.array([refusal.encode()], dtype=np.object_)),
            ]
            responses.append(pb_utils.InferenceResponse(outputs))
        return responses
