"""gpu_default_sender: see config.pbtxt."""

import json
import threading

import torch
import triton_python_backend_utils as pb_utils


def response(request, which):
    value = torch.from_dlpack(pb_utils.get_input_tensor_by_name(request, "IN")).cuda()
    out = value * 10 + which  # queued on the GPU; the answer must not outrun it
    return pb_utils.InferenceResponse([pb_utils.Tensor.from_dlpack("OUT", out)])


class TritonPythonModel:
    def execute(self, requests):
        returned = []
        for request in requests:
            params = json.loads(request.parameters())
            if params.get("mode", "return") == "return":
                returned.append(response(request, 3))
                continue
            sender = request.get_response_sender()
            answer = response(request, 1)  # computed now, sent once the gate opens

            def send(gate=params["gate"], sender=sender, answer=answer):
                with open(gate) as opened:
                    opened.readline()
                sender.send(answer, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

            threading.Thread(target=send, daemon=True).start()
            returned.append(None)
        return None if all(r is None for r in returned) else returned
