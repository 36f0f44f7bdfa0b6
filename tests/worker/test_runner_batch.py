"""A worker's ``execute(requests)`` over several requests (``InferBatch``), run in-process.

- the model gets one InferenceRequest per request, nothing concatenated, and each
  request gets its own reply, with the same timings;
- a wrong number of responses fails every request with Triton's message;
- a request whose inputs cannot be read fails alone; the others run.
And the InferBatch frame survives the codec.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from dlserve import pb_utils as backend
from dlserve.ipc import codec
from dlserve.ipc import messages as m
from dlserve.tensors.arena import ShmSegment
from dlserve.worker.runner import ModelRunner

MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        shapes = [pb_utils.get_input_tensor_by_name(r, "X").as_numpy().shape for r in requests]
        count = len(requests) - (1 if pb_utils.get_input_tensor_by_name(
            requests[0], "X").as_numpy()[0] == -1 else 0)
        return [
            pb_utils.InferenceResponse([
                pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy() * 2),
                pb_utils.Tensor("N", np.array([len(requests)], np.int32)),
                pb_utils.Tensor("SHAPE", np.array(shapes[i], np.int64)),
            ])
            for i, r in enumerate(requests[:count])
        ]
"""


@pytest.fixture
def runner(tmp_path: Path) -> Iterator[ModelRunner]:
    sys.modules["triton_python_backend_utils"] = backend
    model_file = tmp_path / "1" / "model.py"
    model_file.parent.mkdir()
    model_file.write_text(MODEL)
    load = m.Load("batch", 1, str(tmp_path), str(tmp_path), str(model_file),
                  json.dumps({"name": "batch"}), "batch_0", "CPU", 0)  # fmt: skip
    arenas = (ShmSegment.anonymous("in", 1 << 20), ShmSegment.anonymous("out", 1 << 20))
    running = ModelRunner(load, arenas)
    running.start()
    yield running
    running.finalize()


def items(*arrays: np.ndarray) -> tuple[list[m.BatchItem], memoryview]:
    """One BatchItem per array, their bytes one after the other in one payload."""
    result, offset, payload = [], 0, b""
    for rid, array in enumerate(arrays, 1):
        data = array.astype(np.float32).tobytes()
        ref = m.TensorRef("X", "FP32", list(array.shape), m.Where.PAYLOAD, offset, len(data))
        result.append(m.BatchItem(rid=rid, request_id=f"r{rid}", inputs=[ref], outputs=[]))
        payload += data
        offset += len(data)
    return result, memoryview(payload)


def output(done: m.InferDone, buffers: list[memoryview], name: str) -> np.ndarray:
    [ref] = [r for r in done.outputs if r.name == name]
    raw = b"".join(bytes(b) for b in buffers)[ref.offset : ref.offset + ref.nbytes]
    dtype = {"FP32": np.float32, "INT32": np.int32, "INT64": np.int64}[ref.datatype]
    return np.frombuffer(raw, dtype).reshape(ref.shape)


def test_one_request_object_per_request_and_one_reply_each(runner: ModelRunner) -> None:
    batch, payload = items(np.array([1.0, 2.0]), np.array([[3.0], [4.0], [5.0]]))
    replies = runner.execute(batch, [], payload)
    assert [done.rid for done, _ in replies] == [1, 2]
    (first, b1), (second, b2) = replies
    np.testing.assert_array_equal(output(first, b1, "Y"), [2.0, 4.0])
    np.testing.assert_array_equal(output(second, b2, "Y"), [[6.0], [8.0], [10.0]])
    assert output(first, b1, "N")[0] == 2
    assert list(output(second, b2, "SHAPE")) == [3, 1]  # its own shape, not concatenated
    assert first.timings is not None and first.timings == second.timings


def test_a_wrong_number_of_responses_fails_every_request(runner: ModelRunner) -> None:
    batch, payload = items(np.array([-1.0]), np.array([2.0]))  # -1: one response short
    replies = runner.execute(batch, [], payload)
    assert [done.error for done, _ in replies] == [
        "Failed to process the request(s) for model 'batch_0', message: "
        "Number of InferenceResponse objects do not match the number of InferenceRequest "
        "objects. InferenceRequest(s) size is:2, and InferenceResponse(s) size is:1"
    ] * 2


def test_a_request_that_cannot_be_read_fails_alone(runner: ModelRunner) -> None:
    batch, payload = items(np.array([1.0]), np.array([2.0]))
    batch[0].inputs[0].datatype = "NOT_A_TYPE"
    replies = runner.execute(batch, [], payload)
    assert replies[0][0].error_code == "internal"
    assert not replies[1][0].error_code
    assert output(replies[1][0], replies[1][1], "N")[0] == 1  # the model saw one request


def test_infer_batch_survives_the_codec() -> None:
    batch, _ = items(np.array([1.0]), np.array([2.0]))
    msg = m.InferBatch(batch, release=[64])
    frames = codec.encode(msg, [])
    header = b"".join(bytes(f) for f in frames)[codec.PREFIX_SIZE :]
    assert codec.to_worker.decode(header) == msg
