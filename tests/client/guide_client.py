# The client of a published guide to zero-copy GPU tensors with Triton's Python backend
# (its "第二步", step two), re-indented (the published text lost its indentation) and with
# only its two tritonclient imports changed to dlserve's drop-ins.
# The test runs it with "localhost:8001" replaced by the test server's address.
#
# As written, the guide passes the handle to register_cuda_shared_memory as
# `cuda_shm_handle=`, which tritonclient does not take (it names it `raw_handle`): the
# guide's client raises TypeError under plain tritonclient; dlserve.client.grpc takes both.
import numpy as np
import dlserve.client.grpc as grpcclient  # was: import tritonclient.grpc as grpcclient
from dlserve.client import cuda_shared_memory as cudashm  # was: from tritonclient.utils import cuda_shared_memory as cudashm
import torch

# 1. 初始化 Triton 客户端
try:
    triton_client = grpcclient.InferenceServerClient(url="localhost:8001")
except Exception as e:
    print(f"Client creation failed: {e}")
    exit(1)
# 准备测试数据 (假设是 PyTorch GPU Tensor)
input_data = torch.randn(1, 3, 224, 224, device='cuda:0', dtype=torch.float32)
byte_size = input_data.nelement() * input_data.element_size()
# 2. 在 GPU 上创建 CUDA 共享内存区域
# 这个辅助函数会在底层分配 PyTorch / CUDA 显存，并返回句柄
shm_op_handle = cudashm.create_shared_memory_region(
    triton_shm_name="input_shm",
    byte_size=byte_size,
    device_id=0
)
# 3. 将本地 GPU Tensor 的数据拷贝到 CUDA 共享内存中
# 注意：这步是 GPU-to-GPU 拷贝（cudaMemcpyDeviceToDevice），速度极快
cudashm.set_shared_memory_by_cuda_array(
    shm_op_handle,
    input_data.data_ptr(),
    byte_size
)
# 4. 将这块共享内存注册到 Triton Server
# 这会把显存的 CUDA IPC handle 发送给 Triton，告诉它这块内存可供直接映射
triton_client.register_cuda_shared_memory(
    name="input_shm",
    cuda_shm_handle=cudashm.get_raw_handle(shm_op_handle),
    device_id=0,
    byte_size=byte_size
)
# 5. 关联推理解析器
inputs = []
inputs.append(grpcclient.InferInput("INPUT_0", input_data.shape, "FP32"))
# 关键：不直接发送数据包，而是指示 Triton 从已注册的共享内存中读取
inputs[0].set_shared_memory("input_shm", byte_size)
# 6. 发送推理请求
# 同样，如果输出也想走 CUDA Shm，也需要为 Output 注册并关联 shm，此处重点看 Input
response = triton_client.infer(model_name="your_python_model", inputs=inputs)
# 7. 善后处理：注销并释放共享内存，防止显存泄漏
triton_client.unregister_cuda_shared_memory(name="input_shm")
cudashm.destroy_shared_memory_region(shm_op_handle)
print("Inference completed successfully!")
# (added for the test: the answer is checked)
np.testing.assert_allclose(response.as_numpy("OUTPUT_0"), (input_data * 2).cpu().numpy())
print("OUTPUT_0 == 2 * INPUT_0")
