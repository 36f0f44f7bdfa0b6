"""The worker's serve loop, driven frame by frame: a real ``serve()`` in a thread on one
end of a socketpair, the test playing the server on the other end.

- A model that waits on the server inside execute (``Metric.value()``) while the next
  Infer arrives: the link queues it, and serve() runs it after the first.
- The example ``double`` model on a CPU instance and, where CUDA is, on a GPU instance:
  its output is a GPU tensor that reaches the output arena.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from dlserve.ipc import codec
from dlserve.ipc import messages as m
from dlserve.ipc.channel import BlockingChannel
from dlserve.server.core.telemetry.metrics import CustomMetrics
from dlserve.tensors.arena import ShmSegment
from dlserve.worker.main import install_pb_utils, serve

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "models"
COUNTING_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        family = pb_utils.MetricFamily("serve_test_count", "n", pb_utils.MetricFamily.COUNTER)
        self.count = family.Metric(labels={"model": args["model_name"]})

    def execute(self, requests):
        self.count.increment(1)
        seen = np.array([self.count.value()], dtype=np.float64)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("SEEN", seen)]) for _ in requests]
"""
_names = itertools.count()


class Server:
    """The server's end: metric frames go to the real CustomMetrics, replies come back."""

    def __init__(self, sock: socket.socket, arena: ShmSegment, outputs: ShmSegment) -> None:
        self.channel: BlockingChannel[m.WorkerToServer] = BlockingChannel(sock, codec.to_server)
        self.arena = arena
        self.outputs = outputs
        self.metrics = CustomMetrics()
        self.on_call: Callable[[], None] = lambda: None

    def next_frame(self) -> tuple[m.WorkerToServer, memoryview]:
        """The next frame that is not a metric frame, serving metric frames meanwhile."""
        while True:
            msg, payload = self.channel.recv()
            if not isinstance(msg, m.MetricFamilyDef | m.MetricOp | m.MetricValueCall):
                return msg, payload
            reply = self.metrics.handle(msg)
            if reply is not None:
                self.on_call()
                self.channel.send(reply)

    def load(self, model_file: Path, config: dict[str, object], kind: str = "CPU") -> m.Loaded:
        name = str(config["name"])
        self.channel.send(
            m.Load(
                model_name=name, model_version=1, repository=str(model_file.parents[2]),
                model_path=str(model_file.parents[1]), model_file=str(model_file),
                config_json=json.dumps(config), instance_name=f"{name}_0", instance_kind=kind,
                device_id=0,
            )
        )  # fmt: skip
        loaded, _ = self.next_frame()
        assert isinstance(loaded, m.Loaded), loaded
        return loaded

    def stop(self) -> None:
        self.channel.send(m.Shutdown())
        assert isinstance(self.next_frame()[0], m.Closed)


@pytest.fixture
def server() -> Iterator[Server]:
    name = f"dlserve_test_{next(_names)}"
    arena = ShmSegment.anonymous(f"{name}_in", 16 << 20)
    outputs = ShmSegment.anonymous(f"{name}_out", 16 << 20)
    assert arena.fd is not None and outputs.fd is not None
    theirs_arenas = (
        ShmSegment.from_fd(os.dup(arena.fd), arena.name),
        ShmSegment.from_fd(os.dup(outputs.fd), outputs.name),
    )
    ours, theirs = socket.socketpair()
    install_pb_utils()
    channel = BlockingChannel(theirs, codec.to_worker)
    thread = threading.Thread(target=serve, args=(channel, theirs_arenas), daemon=True)
    thread.start()
    try:
        yield Server(ours, arena, outputs)
    finally:
        ours.close()
        thread.join(timeout=30)
        theirs.close()
        arena.close()
        outputs.close()


def infer(rid: int) -> m.Infer:
    return m.Infer(rid=rid, request_id=f"r{rid}", inputs=[], outputs=["SEEN"])


def seen_value(msg: m.WorkerToServer, payload: memoryview, rid: int) -> float:
    assert isinstance(msg, m.InferDone) and msg.rid == rid and msg.error == "", msg
    ref = msg.outputs[0]
    return float(np.frombuffer(payload[ref.offset : ref.offset + ref.nbytes], np.float64)[0])


def test_an_infer_arriving_during_value_is_served_after(server: Server, tmp_path: Path) -> None:
    model_file = tmp_path / "counting" / "1" / "model.py"
    model_file.parent.mkdir(parents=True)
    model_file.write_text(COUNTING_MODEL)
    server.load(model_file, {"name": "counting", "input": [], "output": []})
    pending = [infer(2)]
    # the first value() call is answered only after the next Infer is on its way
    server.on_call = lambda: server.channel.send(pending.pop()) if pending else None
    server.channel.send(infer(1))
    values = [seen_value(*server.next_frame(), rid) for rid in (1, 2)]
    assert values == [1.0, 2.0]  # each value() saw its own increment, in order
    server.stop()


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@pytest.mark.parametrize(
    "kind",
    ["CPU", pytest.param("GPU", marks=[
        pytest.mark.gpu, pytest.mark.skipif(not _cuda_available(), reason="no CUDA device"),
    ])],
)  # fmt: skip
def test_the_double_example_on_its_instance_kind(server: Server, kind: str) -> None:
    pytest.importorskip("torch")
    config = {
        "name": "double", "input": [], "output": [],
        "parameters": {"force_gpu_tensors": {"string_value": "True"}},
    }  # fmt: skip
    server.load(EXAMPLES / "double" / "1" / "model.py", config, kind)
    image = np.random.default_rng(3).standard_normal((1, 3, 224, 224)).astype(np.float32)
    server.arena.buffer[: image.nbytes] = image.tobytes()
    ref = m.TensorRef("INPUT_0", "FP32", list(image.shape), m.Where.INPUT_ARENA, 0, image.nbytes)
    server.channel.send(m.Infer(rid=1, request_id="r1", inputs=[ref], outputs=["OUTPUT_0"]))
    done, payload = server.next_frame()
    assert isinstance(done, m.InferDone) and done.error == "", done
    (out,) = done.outputs
    assert (out.name, out.datatype, out.shape) == ("OUTPUT_0", "FP32", [1, 3, 224, 224])
    if out.where == m.Where.OUTPUT_ARENA:
        data = bytes(server.outputs.buffer[out.offset : out.offset + out.nbytes])
    else:
        data = bytes(payload[out.offset : out.offset + out.nbytes])
    np.testing.assert_array_equal(np.frombuffer(data, np.float32).reshape(image.shape), image * 2)
    server.stop()
