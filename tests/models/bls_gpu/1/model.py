"""bls_gpu: BLS with CUDA tensors passed between models by IPC handle; see config.pbtxt."""

import json

import numpy as np
import triton_python_backend_utils as pb_utils


def call(op, tensor, model="bls_gpu_ops"):
    request = pb_utils.InferenceRequest(
        model_name=model,
        inputs=[tensor],
        requested_output_names=["OUTPUT0"],
        parameters={"op": op},
    )
    response = request.exec()
    if response.has_error():
        raise pb_utils.TritonModelException(response.error().message())
    return pb_utils.get_output_tensor_by_name(response, "OUTPUT0")


def give_back_then_call(x, other, torch):
    """Sum a lent output with work still queued behind a long GPU sleep, drop it (it goes
    back with the next call), and call the callee again at once: the callee's new tensors
    may take the freed memory. The sum is right only when the give-back waited for it."""
    doubled = call("double", pb_utils.Tensor.from_dlpack("INPUT0", x))
    lent = torch.from_dlpack(doubled)
    torch.cuda._sleep(400_000_000)  # about 0.2 s of GPU time, queued before the sum
    total = lent.sum().reshape(1)
    del doubled, lent
    call("double", pb_utils.Tensor("INPUT0", other))  # a host input: no wait for the GPU
    return total


class TritonPythonModel:
    def execute(self, requests):
        import torch

        responses = []
        for request in requests:
            mode = json.loads(request.parameters()).get("mode", "pipeline")
            x = torch.from_dlpack(pb_utils.get_input_tensor_by_name(request, "INPUT0"))
            x = x.cuda()
            if mode == "in_place":
                call("add_one_in_place", pb_utils.Tensor.from_dlpack("INPUT0", x))
                result, on_gpu = x, True
            elif mode == "in_place_late":  # the callee answers before its GPU work is done
                call("add_one_in_place_late", pb_utils.Tensor.from_dlpack("INPUT0", x))
                result, on_gpu = x, True
            elif mode == "late_pipeline":  # a second callee reads the first's late output
                doubled = call("double_late", pb_utils.Tensor.from_dlpack("INPUT0", x))
                renamed = pb_utils.Tensor.from_dlpack("INPUT0", doubled)
                result, on_gpu = torch.from_dlpack(call("add_one", renamed, "bls_gpu_ops_b")), True
            elif mode == "late_side_stream":  # the late output read on a stream of our own
                doubled = call("double_late", pb_utils.Tensor.from_dlpack("INPUT0", x))
                stream = torch.cuda.Stream()
                with torch.cuda.stream(stream):
                    result = torch.from_dlpack(doubled) + 0
                stream.synchronize()
                on_gpu = True
            elif mode == "give_back":
                host = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
                result, on_gpu = give_back_then_call(x, host * 100, torch), True
            else:
                doubled = call("double", pb_utils.Tensor.from_dlpack("INPUT0", x))
                renamed = pb_utils.Tensor.from_dlpack("INPUT0", doubled)
                plus_one = call("add_one", renamed)
                result = torch.from_dlpack(plus_one)
                on_gpu = not doubled.is_cpu() and not plus_one.is_cpu()
            outputs = [
                pb_utils.Tensor("OUTPUT0", result.cpu().numpy()),
                pb_utils.Tensor("OUTPUT1", np.array([float(on_gpu)], dtype=np.float32)),
            ]
            responses.append(pb_utils.InferenceResponse(outputs))
        return responses
