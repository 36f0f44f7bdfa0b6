"""GPU tensors in a worker: where inputs are placed, how GPU outputs reach their place.

Inputs stay where they arrive by default: a tensor in a client's CUDA region is given to
the model as a GPU tensor over the client's own memory (no copy); a tensor from the
request body stays in host memory. Two config parameters change that:
``FORCE_CPU_ONLY_INPUT_TENSORS: "yes"`` (Triton's behaviour: every input on the host) and
``force_gpu_tensors: "true"`` (every input on the instance's GPU; a host-to-device copy for
inputs that came over the wire).

Outputs: a GPU tensor requested into a CUDA region costs one device-to-device copy (none
when the model wrote into the region itself, see :meth:`GpuIO.output_buffer`); a GPU
tensor returned on the wire is copied once, into this worker's output arena, which is
page-locked for CUDA the first time.
"""

from __future__ import annotations

import enum
import importlib.util
import sys
from typing import Any, Final

import numpy as np

from dlserve import pb_utils as pb_utils
from dlserve.ipc import messages as m
from dlserve.pb_utils.exceptions import TritonError
from dlserve.tensors import cuda_ipc, dlpack, dtypes
from dlserve.tensors.arena import Arena, buffer_address
from dlserve.worker.client_regions import ClientRegions

_TRUE: Final = ("1", "on", "true", "yes")
_FALSE: Final = ("0", "off", "false", "no")


class Placement(enum.Enum):
    AS_ARRIVED = "as arrived"
    HOST = "host"  # FORCE_CPU_ONLY_INPUT_TENSORS: yes
    GPU = "gpu"  # force_gpu_tensors: true


def _flag(config: dict[str, Any], key: str) -> bool:
    entry = config.get("parameters", {}).get(key)
    if entry is None:
        return False
    value = str(entry.get("string_value", "")).strip().lower()
    if value not in _TRUE + _FALSE:
        raise ValueError(f"parameter '{key}' must be yes/no or true/false, not {value!r}")
    return value in _TRUE


def placement_of(config: dict[str, Any], instance_kind: str) -> Placement:
    """The input placement a model's config asks for; ValueError when it cannot be had."""
    force_cpu = _flag(config, "FORCE_CPU_ONLY_INPUT_TENSORS")
    force_gpu = _flag(config, "force_gpu_tensors")
    if force_cpu and force_gpu:
        raise ValueError(
            "parameters 'FORCE_CPU_ONLY_INPUT_TENSORS' and 'force_gpu_tensors' are both set: "
            "inputs cannot be forced onto the host and onto the GPU"
        )
    if force_gpu and instance_kind != "GPU":
        # A portable config (no instance kind) runs on the CPU where there is no GPU.
        print(
            f"dlserve worker: parameter 'force_gpu_tensors' is ignored: this instance is "
            f"KIND_{instance_kind}, it has no GPU to put inputs on",
            file=sys.stderr,
        )
        return Placement.AS_ARRIVED
    if force_gpu:
        return Placement.GPU
    return Placement.HOST if force_cpu else Placement.AS_ARRIVED


def _cuda(what: str, call: Any, *args: Any) -> Any:
    try:
        return call(*args)
    except (cuda_ipc.CudaUnavailable, cuda_ipc.CudaError) as exc:
        raise TritonError(f"{what}: {exc}", TritonError.INTERNAL) from None


def _gpu_tensor(name: str, ptr: int, ref_shape: list[int], dtype: dtypes.DType,
                device: int, owner: object) -> pb_utils.Tensor:  # fmt: skip
    info = dlpack.DLTensorInfo(ptr, tuple(ref_shape), None, dtype, dlpack.CUDA, device, False)
    return pb_utils.Tensor._wrap_gpu(name, info, owner)


class GpuIO:
    """Input placement and GPU output copies for one model instance."""

    def __init__(self, placement: Placement, device: int, regions: ClientRegions,
                 output_arena: Arena) -> None:  # fmt: skip
        self.placement = placement
        self.device = device  # the instance's GPU (for force_gpu_tensors)
        self.regions = regions
        self.output_arena = output_arena
        self._arena_pinned = False

    # -- inputs ---------------------------------------------------------------------------
    def region_input(self, ref: m.TensorRef) -> pb_utils.Tensor:
        """An input in a client's CUDA region: a view of it (or a host copy when asked)."""
        dtype = dtypes.BY_WIRE[ref.datatype]
        ptr = self.regions.cuda_pointer(ref, f"input '{ref.name}'")
        if dtype.is_bytes or self.placement is Placement.HOST:
            host = np.empty(ref.nbytes, dtype=np.uint8)
            _cuda(f"copying input '{ref.name}' to the host", cuda_ipc.copy,
                  host.ctypes.data, ptr, ref.nbytes)  # fmt: skip
            if dtype.is_bytes:
                array = dtypes.deserialize_bytes(host.data).reshape(ref.shape)
            else:
                array = host.view(dtype.numpy_storage).reshape(ref.shape)
            return pb_utils.Tensor._wrap(ref.name, array, dtype)
        return _gpu_tensor(ref.name, ptr, ref.shape, dtype, ref.device, None)

    def place(self, tensor: pb_utils.Tensor) -> pb_utils.Tensor:
        """A host input moved to the instance's GPU when the config forces GPU inputs."""
        if self.placement is not Placement.GPU or not tensor.is_cpu() or tensor.dtype.is_bytes:
            return tensor
        array = tensor.storage
        buffer = _cuda(f"allocating GPU memory for input '{tensor.name()}'",
                       cuda_ipc.DeviceBuffer, array.nbytes, self.device)  # fmt: skip
        _cuda(f"copying input '{tensor.name()}' to GPU {self.device}", cuda_ipc.copy,
              buffer.ptr, array.ctypes.data, array.nbytes)  # fmt: skip
        shape = list(array.shape)
        return _gpu_tensor(tensor.name(), buffer.ptr, shape, tensor.dtype, self.device, buffer)

    # -- outputs --------------------------------------------------------------------------
    def to_cuda_region(self, name: str, source: int, nbytes: int, target: m.TensorRef) -> None:
        """Copy an output (from a GPU or host address) into a client's CUDA region."""
        dst = self.regions.cuda_pointer(target, f"output '{name}'")
        if source != dst:
            _cuda(f"copying output '{name}' into CUDA shared memory", cuda_ipc.copy,
                  dst, source, nbytes)  # fmt: skip

    def to_host(self, tensor: pb_utils.Tensor, view: memoryview) -> None:
        """Copy a GPU output into host memory (a system region, or the output arena)."""
        info = tensor.gpu_info
        assert info is not None
        dst = buffer_address(view)
        if dst != info.ptr:
            _cuda(f"copying output '{tensor.name()}' to host memory", cuda_ipc.copy,
                  dst, info.ptr, view.nbytes)  # fmt: skip

    def pin_output_arena(self) -> None:
        """Page-lock the output arena once, so device-to-host copies into it run at full
        speed (a failure only costs speed)."""
        if self._arena_pinned:
            return
        self._arena_pinned = True
        buffer = self.output_arena.segment.buffer
        try:
            cuda_ipc.pin_host_memory(buffer_address(buffer), buffer.nbytes)
        except (cuda_ipc.CudaUnavailable, cuda_ipc.CudaError):
            pass

    def output_buffer(
        self, name: str, shape: list[int], dtype: dtypes.DType, target: m.TensorRef
    ) -> pb_utils.Tensor:
        """A GPU tensor over an output's place in a client's CUDA region."""
        ptr = self.regions.cuda_pointer(target, f"output '{name}'")
        return _gpu_tensor(name, ptr, shape, dtype, target.device, None)


def bind_device(device: int) -> str:
    """Make ``device`` the current CUDA device of this process's main thread, for
    cuda-python and for torch where torch is installed; returns the device's UUID ("" when
    no CUDA library is there to ask)."""
    uuid = ""
    try:
        cuda_ipc.set_device(device)
        uuid = cuda_ipc.device_uuid(device)
    except cuda_ipc.CudaUnavailable:
        pass
    except cuda_ipc.CudaError as exc:
        raise ValueError(f"cannot use GPU {device}: {exc}") from None
    if importlib.util.find_spec("torch") is not None:
        import torch

        if torch.cuda.is_available():
            torch.cuda.set_device(device)
            if not uuid:
                uuid = f"GPU-{torch.cuda.get_device_properties(device).uuid}"
    return uuid
