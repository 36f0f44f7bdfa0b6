"""double: OUTPUT_0 = INPUT_0 * 2, with torch through DLPack (no copy into torch).

Written for Triton's Python backend. Runs on the GPU when its instance is a GPU
instance (and torch sees CUDA), on the CPU otherwise; the input may arrive in host
or GPU memory either way. Without torch it falls back to numpy and says so.
"""

import json

import triton_python_backend_utils as pb_utils

try:
    import torch
    from torch.utils.dlpack import from_dlpack, to_dlpack
except ImportError:  # torch is optional: numpy does the same arithmetic
    torch = None


def _flag(config, key):
    value = config.get("parameters", {}).get(key, {}).get("string_value", "")
    return value.strip().lower() in ("true", "yes", "1", "on")


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.keep_on_gpu = _flag(config, "force_gpu_tensors")
        self.device = self._pick_device(args)
        pb_utils.Logger.log_info(f"double computes on {self.device or 'the CPU with numpy'}")

    def _pick_device(self, args):
        if torch is None:
            pb_utils.Logger.log_warn("torch is not installed: double falls back to numpy")
            return None
        if args["model_instance_kind"] == "GPU" and torch.cuda.is_available():
            return torch.device("cuda", int(args["model_instance_device_id"]))
        if self.keep_on_gpu:
            pb_utils.Logger.log_info("force_gpu_tensors is set, but this is a CPU instance")
        return torch.device("cpu")

    def execute(self, requests):
        responses = []
        for request in requests:
            tensor = pb_utils.get_input_tensor_by_name(request, "INPUT_0")
            output = self._double(tensor)
            responses.append(pb_utils.InferenceResponse(output_tensors=[output]))
        return responses

    def _double(self, tensor):
        if self.device is None:
            return pb_utils.Tensor("OUTPUT_0", tensor.as_numpy() * 2)
        # A view of the input's memory, wherever it is; .to() copies only when needed.
        doubled = from_dlpack(tensor.to_dlpack()).to(self.device) * 2.0
        if doubled.is_cuda and not self.keep_on_gpu:
            doubled = doubled.cpu()
        return pb_utils.Tensor.from_dlpack("OUTPUT_0", to_dlpack(doubled))

    def finalize(self):
        pb_utils.Logger.log_info("double finalized")
