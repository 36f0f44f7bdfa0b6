"""bad_gpu_callee: bad_callee whose OUTPUT0 is a CUDA tensor (torch), lent to a BLS caller
by IPC handle; HELD counts the output-arena pieces and the lent GPU outputs in use when
execute began. A negative first element of INPUT0 names OUTPUT0 with bytes (a private
attribute set), so the reply is a frame its reader cannot read."""

import gc
import os

import numpy as np
import triton_python_backend_utils as pb_utils

from dlserve.worker.bls.gpu_lending import GpuLender
from dlserve.worker.link import link


class TritonPythonModel:
    def execute(self, requests):
        import torch

        memory = link.current().memory
        [lender] = [o for o in gc.get_objects() if isinstance(o, GpuLender)]  # the instance's
        held = len(memory.output_arena._used) + len(lender._lent)
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            output = pb_utils.Tensor.from_dlpack("OUTPUT0", torch.from_numpy(x.copy()).cuda())
            if x.size and x[0] < 0:
                output._name = b"OUTPUT0"
            pid = pb_utils.Tensor("PID", np.array([os.getpid()], dtype=np.int64))
            in_use = pb_utils.Tensor("HELD", np.array([held], dtype=np.int64))
            responses.append(pb_utils.InferenceResponse([output, pid, in_use]))
        return responses
