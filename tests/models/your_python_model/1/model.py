import triton_python_backend_utils as pb_utils
import torch
from torch.utils.dlpack import from_dlpack, to_dlpack


class TritonPythonModel:
    def initialize(self, args):
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        print("Model initialized on device:", self.device)

    def execute(self, requests):
        responses = []
        for request in requests:
            # 1. 获取输入 Tensor
            input_tensor = pb_utils.get_input_tensor_by_name(request, "INPUT_0")

            # 2. 安全检查：确保拿到的是 GPU 上的 Tensor
            if input_tensor.is_cpu():
                raise pb_utils.TritonModelException(
                    "Input tensor is on CPU, CUDA Shared Memory optimization failed!"
                )

            # 3. 核心步骤：通过 DLPack 实现零拷贝转换
            # to_dlpack() 是 Triton 封装的底层方法，可以直接暴露 GPU 显存指针
            dlpack_tensor = input_tensor.to_dlpack()

            # 转换为 PyTorch GPU Tensor
            pytorch_tensor = from_dlpack(dlpack_tensor)

            # 验证 pytorch_tensor 是否真的在 GPU 上且能正常计算
            # 这里的后续操作完全不涉及任何 CPU 拷贝
            processed_tensor = pytorch_tensor * 2.0

            # 4. 准备输出
            # 同样使用 DLPack 把 PyTorch Tensor 转回 Triton Tensor，保持零拷贝
            out_dlpack = to_dlpack(processed_tensor)
            triton_output = pb_utils.Tensor.from_dlpack("OUTPUT_0", out_dlpack)

            inference_response = pb_utils.InferenceResponse(
                output_tensors=[triton_output]
            )
            responses.append(inference_response)

        return responses

    def finalize(self):
        print("Model finalized.")
