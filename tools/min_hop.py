"""What a direct BLS call costs above the least a call between two Python processes can
cost, on this machine: the headroom of dlserve's direct-call path.

- ``minimal``: two processes over a socketpair, built of dlserve's own pieces and nothing
  else: the caller wraps 16 floats in a pb_utils Tensor, sends an ``Infer`` frame with
  them inline (``BlockingChannel``, busy polling as ``--busy-poll-us 2000`` does); the
  callee decodes it, builds the pb_utils request, runs ``x * 2``, builds the response and
  sends an ``InferDone`` with the output inline; the caller wraps the output. No checks,
  no statistics, no lending, no server. Between calls the caller spins 400 us in Python,
  as a pipeline's caller does other work between its calls.
- ``dlserve``: the same call through dlserve: a model ``caller`` whose ``execute`` times
  ``InferenceRequest(...).exec()`` of a model ``times2`` (``x * 2``, numpy) and
  ``get_output_tensor_by_name`` on the answer, served by ``dlserve serve --busy-poll-us
  2000`` (a direct call: worker to worker, the server not on the path).

The two alternate (``--rounds``); each prints the call's p50.

    python tools/min_hop.py [--rounds 2] [--requests 4000]

A probe for developers, not a benchmark of record (Linux: the minimal pair forks).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "src"))
import _triton  # noqa: E402  (benchmarks/_triton.py: a module, not a package)

from dlserve import pb_utils as pb_utils  # noqa: E402
from dlserve.ipc import codec  # noqa: E402
from dlserve.ipc import messages as m  # noqa: E402
from dlserve.ipc.channel import BlockingChannel  # noqa: E402

SPIN_NS = 2_000_000  # --busy-poll-us 2000
GAP_S = 0.0004  # the caller's other work between two calls
WARMUP = 500

CALLEE = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUTPUT_0", pb_utils.get_input_tensor_by_name(r, "INPUT_0").as_numpy() * 2)])
            for r in requests]
"""

CALLER = """
import time
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            data = pb_utils.get_input_tensor_by_name(request, "INPUT_0")
            start = time.perf_counter()
            answer = pb_utils.InferenceRequest(model_name="times2", inputs=[data],
                                               requested_output_names=["OUTPUT_0"]).exec()
            doubled = pb_utils.get_output_tensor_by_name(answer, "OUTPUT_0")
            took = (time.perf_counter() - start) * 1e6
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUTPUT_0", doubled.as_numpy()),
                pb_utils.Tensor("CALL_US", np.array([took]))]))
        return responses
"""

CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "INPUT_0" data_type: TYPE_FP32 dims: [ -1 ] }} ]
output [ {{ name: "OUTPUT_0" data_type: TYPE_FP32 dims: [ -1 ] }}{extra} ]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
"""


def _inline(name: str, data: memoryview) -> m.TensorRef:
    return m.TensorRef(name, "FP32", [data.nbytes // 4], m.Where.PAYLOAD, 0, data.nbytes)


def _minimal_callee(sock: socket.socket) -> None:
    channel = BlockingChannel(sock, codec.to_worker, spin_ns=SPIN_NS)
    while True:
        msg, payload = channel.recv()
        assert isinstance(msg, m.Infer)
        ref = msg.inputs[0]
        array = np.frombuffer(payload[ref.offset : ref.offset + ref.nbytes], np.float32)
        request = pb_utils.InferenceRequest._received(
            "times2", [pb_utils.Tensor(ref.name, array)], msg.outputs, msg.request_id, {}
        )
        doubled = pb_utils.get_input_tensor_by_name(request, "INPUT_0").as_numpy() * 2
        response = pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT_0", doubled)])
        data = response.output_tensors()[0].as_numpy().data.cast("B")
        channel.send(m.InferDone(msg.rid, outputs=[_inline("OUTPUT_0", data)]), [data])


def minimal(requests: int) -> float:
    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        ours.close()
        try:
            _minimal_callee(theirs)
        finally:
            os._exit(0)
    theirs.close()
    channel = BlockingChannel(ours, codec.to_server, spin_ns=SPIN_NS)
    x = np.arange(16, dtype=np.float32)
    took = []
    try:
        for call in range(WARMUP + requests):
            start = time.perf_counter_ns()
            data = pb_utils.Tensor("INPUT_0", x).as_numpy().data.cast("B")
            infer = m.Infer(
                rid=-call - 1, inputs=[_inline("INPUT_0", data)], outputs=["OUTPUT_0"], lend=True
            )
            channel.send(infer, [data])
            msg, payload = channel.recv()
            assert isinstance(msg, m.InferDone)
            ref = msg.outputs[0]
            out = np.frombuffer(payload[ref.offset : ref.offset + ref.nbytes], np.float32)
            pb_utils.Tensor(ref.name, out)
            took.append(time.perf_counter_ns() - start)
            gap_end = time.perf_counter() + GAP_S
            while time.perf_counter() < gap_end:
                pass
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        ours.close()
    return statistics.median(took[WARMUP:]) / 1e3


def through_dlserve(repository: Path, requests: int) -> float:
    import tritonclient.grpc as grpcclient

    with _triton.run_dlserve(repository, *_triton.free_ports(3), "--busy-poll-us", "2000") as s:
        client = grpcclient.InferenceServerClient(s.grpc_url)
        tensor = grpcclient.InferInput("INPUT_0", [16], "FP32")
        tensor.set_data_from_numpy(np.arange(16, dtype=np.float32))
        took = [client.infer("caller", [tensor]).as_numpy("CALL_US")[0]
                for _ in range(WARMUP + requests)]  # fmt: skip
        client.close()
    return float(statistics.median(took[WARMUP:]))


def build(root: Path) -> None:
    extra = ', { name: "CALL_US" data_type: TYPE_FP64 dims: [ -1 ] }'
    for name, code, outputs in (("times2", CALLEE, ""), ("caller", CALLER, extra)):
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(CONFIG.format(name=name, extra=outputs))
        (root / name / "1" / "model.py").write_text(textwrap.dedent(code))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=4000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        build(Path(tmp))
        for round_ in range(args.rounds):
            low = minimal(args.requests)
            direct = through_dlserve(Path(tmp), args.requests)
            print(f"round {round_}: minimal call p50 {low:.1f} us, dlserve's direct call "
                  f"{direct:.1f} us ({direct / low:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
