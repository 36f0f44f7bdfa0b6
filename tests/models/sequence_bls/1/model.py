"""A model without sequence batching that passes its request's correlation_id() and
flags() on to the stateful accumulator (../sequence_acc) through BLS. Returns what it
received itself (MY_ID as repr, MY_FLAGS) and the accumulator's SUM, ID and FLAGS."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            call = pb_utils.InferenceRequest(
                model_name="sequence_acc",
                inputs=[pb_utils.get_input_tensor_by_name(request, "INPUT")],
                requested_output_names=["SUM", "ID", "FLAGS"],
                correlation_id=request.correlation_id(),
                flags=request.flags(),
            )
            reply = call.exec()
            if reply.has_error():
                responses.append(pb_utils.InferenceResponse(error=reply.error()))
                continue
            outputs = [pb_utils.get_output_tensor_by_name(reply, n) for n in ("SUM", "ID", "FLAGS")]
            outputs += [
                pb_utils.Tensor("MY_ID", np.array([repr(request.correlation_id())], np.object_)),
                pb_utils.Tensor("MY_FLAGS", np.array([request.flags()], np.int32)),
            ]
            responses.append(pb_utils.InferenceResponse(outputs))
        return responses
