"""Where a BLS hop's time goes: the caller times each ``exec()``, each callee times its own
``execute``, the server's statistics give its side; single model against BLS pipeline.

Builds a model repository in a temporary folder: ``t_single`` (x * 2 + 1), ``t_bls``
(calls ``t_times2`` then ``t_plus1``), each callee returning how long its ``execute``
took (``EXEC_US``) and the caller returning how long each ``exec()`` took (``TIMES``).
``--device gpu``: torch on the GPU, input and output in CUDA shared memory, 1x3x224x224;
``--device cpu``: numpy, 16 floats on the wire.

    python tools/bls_hops.py [--device gpu|cpu] [--requests N]
        [--busy-poll-us US] [--mps] [--bls-only] [--dlserve-args "..."]

A probe for developers, not a benchmark of record.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import _triton  # benchmarks/_triton.py: a module, not a package

CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "INPUT_0" data_type: TYPE_FP32 dims: [ -1 ] }} ]
output [ {{ name: "OUTPUT_0" data_type: TYPE_FP32 dims: [ -1 ] }},
         {{ name: "{extra}" data_type: TYPE_FP64 dims: [ -1 ] }} ]
parameters: {{ key: "FORCE_CPU_ONLY_INPUT_TENSORS" value: {{ string_value: "no" }} }}
instance_group [ {{ count: 1 kind: {kind} }} ]
"""

CALLEE = """
import time
import numpy as np
import triton_python_backend_utils as pb_utils
GPU = {gpu}
if GPU:
    from torch.utils.dlpack import from_dlpack, to_dlpack


def cpu_probe():
    # a fixed piece of pure-Python work: how fast this process's CPU runs right now
    start = time.perf_counter()
    total = 0
    for i in range(300):
        total += i * i
    return time.perf_counter() - start


class TritonPythonModel:
    def execute(self, requests):
        cpu = cpu_probe()
        start = time.perf_counter()
        responses = []
        for request in requests:
            tensor = pb_utils.get_input_tensor_by_name(request, "INPUT_0")
            got = time.perf_counter()
            if GPU:
                data = from_dlpack(tensor.to_dlpack())
                imported = time.perf_counter()
                result = {expr}
                computed = time.perf_counter()
                out = pb_utils.Tensor.from_dlpack("OUTPUT_0", to_dlpack(result))
            else:
                data = tensor.as_numpy()
                imported = time.perf_counter()
                result = {expr}
                computed = time.perf_counter()
                out = pb_utils.Tensor("OUTPUT_0", result.astype(np.float32))
            end = time.perf_counter()
            # the whole body, then its steps: input, import, compute, export, then the CPU
            # probe's time (microseconds)
            took = np.array([end - start, got - start, imported - got, computed - imported,
                             end - computed, cpu]) * 1e6
            responses.append(pb_utils.InferenceResponse([out, pb_utils.Tensor("EXEC_US", took)]))
        return responses
"""

CALLER = """
import time
import numpy as np
import triton_python_backend_utils as pb_utils


def call(model, tensor):
    start = time.perf_counter()
    request = pb_utils.InferenceRequest(
        model_name=model, inputs=[tensor], requested_output_names=["OUTPUT_0", "EXEC_US"]
    )
    response = request.exec()
    took = (time.perf_counter() - start) * 1e6
    if response.has_error():
        raise pb_utils.TritonModelException(response.error().message())
    out = pb_utils.get_output_tensor_by_name(response, "OUTPUT_0")
    callee = pb_utils.get_output_tensor_by_name(response, "EXEC_US").as_numpy()
    return out, took, callee


class TritonPythonModel:
    def execute(self, requests):
        start = time.perf_counter()
        responses = []
        for request in requests:
            data = pb_utils.get_input_tensor_by_name(request, "INPUT_0")
            doubled, t1, c1 = call("t_times2", data)
            result, t2, c2 = call("t_plus1", pb_utils.Tensor.from_dlpack("INPUT_0", doubled))
            output = pb_utils.Tensor.from_dlpack("OUTPUT_0", result)
            took = (time.perf_counter() - start) * 1e6
            times = np.array([t1, c1[0], t2, c2[0], took, *c1[1:], *c2[1:]])
            responses.append(pb_utils.InferenceResponse([output, pb_utils.Tensor("TIMES", times)]))
        return responses
"""


def build(root: Path, gpu: bool) -> None:
    kind = "KIND_GPU" if gpu else "KIND_CPU"
    models = {
        "t_single": ("EXEC_US", CALLEE.format(gpu=gpu, expr="data * 2 + 1")),
        "t_times2": ("EXEC_US", CALLEE.format(gpu=gpu, expr="data * 2")),
        "t_plus1": ("EXEC_US", CALLEE.format(gpu=gpu, expr="data + 1")),
        "t_bls": ("TIMES", CALLER),
    }
    for name, (extra, code) in models.items():
        (root / name / "1").mkdir(parents=True)
        config = CONFIG.format(name=name, extra=extra, kind=kind)
        (root / name / "config.pbtxt").write_text(config)
        (root / name / "1" / "model.py").write_text(textwrap.dedent(code))


def stats(client: Any, model: str) -> dict[str, float]:
    s = client.get_inference_statistics(model).model_stats[0].inference_stats
    return {
        "count": s.success.count,
        "queue": s.queue.ns,
        "input": s.compute_input.ns,
        "infer": s.compute_infer.ns,
        "output": s.compute_output.ns,
    }


def run(url: str, model: str, gpu: bool, requests: int, extra: str) -> None:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    n = 3 * 224 * 224 if gpu else 16
    data = np.arange(n, dtype=np.float32)
    inp = grpcclient.InferInput("INPUT_0", [n], "FP32")
    out = grpcclient.InferRequestedOutput("OUTPUT_0")
    regions = []
    if gpu:
        import tritonclient.utils.cuda_shared_memory as cudashm

        tag = f"hops_{os.getpid()}_{model}"
        regions = [cudashm.create_shared_memory_region(f"{tag}_{x}", n * 4, 0) for x in "io"]
        for x, region in zip("io", regions, strict=True):
            client.register_cuda_shared_memory(f"{tag}_{x}", cudashm.get_raw_handle(region), 0,
                                               n * 4)  # fmt: skip
        cudashm.set_shared_memory_region(regions[0], [data])
        inp.set_shared_memory(f"{tag}_i", n * 4)
        out.set_shared_memory(f"{tag}_o", n * 4)
    else:
        inp.set_data_from_numpy(data)
    outputs = [out, grpcclient.InferRequestedOutput(extra)]
    for _ in range(200):
        client.infer(model, [inp], outputs=outputs)
    names = [model] if model == "t_single" else [model, "t_times2", "t_plus1"]
    before = {name: stats(client, name) for name in names}
    lat, inner = [], []
    for _ in range(requests):
        start = time.perf_counter()
        result = client.infer(model, [inp], outputs=outputs)
        lat.append((time.perf_counter() - start) * 1e6)
        inner.append(result.as_numpy(extra))
    after = {name: stats(client, name) for name in names}
    inner_p50 = np.percentile(np.array(inner).reshape(len(inner), -1), 50, axis=0)
    print(f"{model}: client p50 {np.percentile(lat, 50):.0f} us, p99 {np.percentile(lat, 99):.0f}")
    steps = ["input", "import", "compute", "export", "cpu probe"]
    if model == "t_single":
        labels = ["exec", *steps]
    else:
        labels = ["exec1 call", "callee1 exec", "exec2 call", "callee2 exec", "caller execute",
                  *(f"callee1 {s}" for s in steps), *(f"callee2 {s}" for s in steps)]  # fmt: skip
    pairs = zip(labels, inner_p50, strict=False)
    print("  in-model p50 us: " + ", ".join(f"{label} {value:.0f}" for label, value in pairs))
    for name in names:
        d = {k: after[name][k] - before[name][k] for k in after[name]}
        count = max(d.pop("count"), 1)
        print(f"  server stats {name}: " + ", ".join(f"{k} {v / count / 1e3:.0f}"
                                                   for k, v in d.items()))  # fmt: skip
    if gpu:
        import tritonclient.utils.cuda_shared_memory as cudashm

        client.unregister_cuda_shared_memory()
        for region in regions:
            cudashm.destroy_shared_memory_region(region)
    client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--busy-poll-us", type=int, default=0)
    parser.add_argument("--mps", action="store_true", help="dlserve's --mps")
    parser.add_argument("--bls-only", action="store_true", help="skip the single model")
    parser.add_argument("--dlserve-args", default="", help="more `dlserve serve` options")
    args = parser.parse_args()
    gpu = args.device == "gpu"
    with tempfile.TemporaryDirectory() as tmp:
        build(Path(tmp), gpu)
        ports = _triton.free_ports(3)
        extra = ["--busy-poll-us", str(args.busy_poll_us), *(["--mps"] if args.mps else []),
                 *args.dlserve_args.split()]  # fmt: skip
        with _triton.run_dlserve(Path(tmp), *ports, *extra) as s:
            if not args.bls_only:
                run(s.grpc_url, "t_single", gpu, args.requests, "EXEC_US")
            run(s.grpc_url, "t_bls", gpu, args.requests, "TIMES")


if __name__ == "__main__":
    main()
