"""gpu_ops: one GPU path per request, chosen by the request parameter "op".

double       OUTPUT_0 = INPUT_0 * 2 with torch through DLPack
double_cupy  the same with cupy
in_place     INPUT_0 += 1 where it lies (the client's memory when it is in a CUDA region);
             OUTPUT_0 is the input tensor itself
producer_gc  OUTPUT_0 = INPUT_0 * 3 from a torch tensor that is deleted, garbage-collected
             and whose memory is reused right after from_dlpack
buffer       writes INPUT_0 * 2 straight into get_output_buffer's tensor and returns it
as_numpy     OUTPUT_0 = INPUT_0.as_numpy() * 2, on the host
in_place_late  INPUT_0 += 1 queued behind a 0.2 s GPU sleep; OUTPUT_0 = [0] on the host
             (nothing in the answer itself waits for the GPU work)

Every response says, in its parameters, where the input was (is_cpu, input_device), the
worker's current CUDA device for torch, the instance's device UUID from args, and for
"buffer" whether the output buffer was on the GPU.
"""

import gc
import json

import numpy as np
import torch
import triton_python_backend_utils as pb_utils
from torch.utils.dlpack import from_dlpack, to_dlpack


class TritonPythonModel:
    def initialize(self, args):
        self.uuid = args["model_instance_device_uuid"]
        self.device_at_initialize = torch.cuda.current_device()

    def execute(self, requests):
        return [self._one(request) for request in requests]

    def _one(self, request):
        tensor = pb_utils.get_input_tensor_by_name(request, "INPUT_0")
        op = json.loads(request.parameters()).get("op", "double")
        parameters = {
            "is_cpu": tensor.is_cpu(),
            "input_device": tensor.__dlpack_device__()[1] if not tensor.is_cpu() else -1,
            "current_device": torch.cuda.current_device(),
            "device_at_initialize": self.device_at_initialize,
            "uuid": self.uuid,
        }
        output = getattr(self, op)(request, tensor, parameters)
        return pb_utils.InferenceResponse([output], parameters=parameters)

    def double(self, request, tensor, parameters):
        doubled = from_dlpack(tensor.to_dlpack()) * 2
        return pb_utils.Tensor.from_dlpack("OUTPUT_0", to_dlpack(doubled))

    def double_cupy(self, request, tensor, parameters):
        import cupy

        doubled = cupy.from_dlpack(tensor) * 2
        return pb_utils.Tensor.from_dlpack("OUTPUT_0", doubled)

    def in_place(self, request, tensor, parameters):
        view = torch.from_dlpack(tensor)
        view += 1
        return pb_utils.Tensor.from_dlpack("OUTPUT_0", view)

    def producer_gc(self, request, tensor, parameters):
        produced = from_dlpack(tensor.to_dlpack()).to("cuda") * 3
        output = pb_utils.Tensor.from_dlpack("OUTPUT_0", to_dlpack(produced))
        size = produced.numel()
        del produced
        gc.collect()
        torch.cuda.empty_cache()
        scribble = torch.full((size * 4,), -7.0, device="cuda")  # reuses freed memory if it can
        torch.cuda.synchronize()
        del scribble
        return output

    def buffer(self, request, tensor, parameters):
        source = torch.from_dlpack(tensor)
        out = pb_utils.get_output_buffer(request, "OUTPUT_0", list(source.shape), "FP32")
        parameters["buffer_is_cpu"] = out.is_cpu()
        torch.mul(source.to(torch.from_dlpack(out).device), 2, out=torch.from_dlpack(out))
        return out

    def in_place_late(self, request, tensor, parameters):
        view = torch.from_dlpack(tensor)
        for _ in range(200):  # short kernels: the GPU may switch to the reader between them
            torch.cuda._sleep(2_000_000)
        view += 1
        return pb_utils.Tensor("OUTPUT_0", np.zeros(1, dtype=np.float32))

    def as_numpy(self, request, tensor, parameters):
        return pb_utils.Tensor("OUTPUT_0", tensor.as_numpy() * 2)
