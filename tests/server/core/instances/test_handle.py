"""A worker handle driven in this process, with its worker in a thread: a reply is read
where it arrives (the callback gets the finished outcome: outputs copied out of the
output arena, or held in place, or the model's error), and every frame a worker sends
has its handler."""

from __future__ import annotations

import asyncio
import json
import typing
from pathlib import Path

import numpy as np

from dlserve import errors
from dlserve.ipc import messages as m
from dlserve.server.core.instances.handle import WorkerHandle, WorkItem
from dlserve.server.core.instances.pool import spawn_worker
from dlserve.server.core.instances.replies import Outcome, WorkerReply
from dlserve.server.core.instances.thread import ThreadLauncher
from dlserve.types import InputTensor

BIG = 100_000  # floats: 400 KB, more than goes inline in a frame
LARGE = 16 * 1024 * 1024  # floats: 64 MiB, more than is copied out on the event loop

MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            if x[0] < 0:
                error = pb_utils.TritonError("negative input")
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            big = np.full({big}, x[0], dtype=np.float32)
            outputs = [pb_utils.Tensor("SMALL", x * 2), pb_utils.Tensor("BIG", big)]
            responses.append(pb_utils.InferenceResponse(outputs))
        return responses
"""


def _tensor(name: str, dims: list[int]) -> dict[str, typing.Any]:
    return {"name": name, "data_type": "TYPE_FP32", "dims": dims}


def _load(root: Path, big: int = BIG) -> m.Load:
    version = root / "two_sizes" / "1"
    version.mkdir(parents=True)
    (version / "model.py").write_text(MODEL.format(big=big))
    config = {"name": "two_sizes", "backend": "python", "max_batch_size": 0,
              "input": [_tensor("X", [1])],
              "output": [_tensor("SMALL", [1]), _tensor("BIG", [big])]}  # fmt: skip
    model_file = str(version / "model.py")
    return m.Load("two_sizes", 1, str(root), str(root / "two_sizes"), model_file,
                  json.dumps(config), "two_sizes_0", "CPU", 0)  # fmt: skip


async def _run(worker: WorkerHandle, x: float, *, keep: bool = False) -> Outcome:
    """Submit one request; the outcome its callback got."""
    future: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
    data = memoryview(np.array([x], dtype=np.float32).tobytes())
    item = WorkItem("r", [InputTensor("X", "FP32", (1,), data)], [], {}, keep=keep)
    worker.submit([item], [future.set_result])
    return await asyncio.wait_for(future, 30)


def _outputs(reply: Outcome) -> dict[str, np.ndarray]:
    assert isinstance(reply, WorkerReply) and reply.error is None
    return {o.name: np.frombuffer(o.data or b"", dtype=np.float32) for o in reply.outputs}


def test_a_reply_reaches_its_callback_read(tmp_path: Path) -> None:
    async def scenario() -> None:
        worker = await spawn_worker("two_sizes_0", True, None)
        try:
            await worker.load(_load(tmp_path), 30)
            copied = await _run(worker, 3.0)
            assert isinstance(copied, WorkerReply)
            assert isinstance(copied.outputs[1].data, bytes)  # copied out of the output arena
            assert copied.held == [] and copied.worker is None
            outputs = _outputs(copied)
            assert outputs["SMALL"].tolist() == [6.0] and (outputs["BIG"] == 3.0).all()
            held = await _run(worker, 4.0, keep=True)  # viewed in place until given back
            assert isinstance(held, WorkerReply)
            assert isinstance(held.outputs[1].data, memoryview)
            assert len(held.held) == 1 and held.worker is worker
            assert (_outputs(held)["BIG"] == 4.0).all()
            worker.release_outputs(held.held)
            failed = await _run(worker, -1.0)
            assert isinstance(failed, WorkerReply) and failed.outputs == []
            assert isinstance(failed.error, errors.ModelError)
            assert failed.error.message == "negative input"
            again = _outputs(await _run(worker, 5.0))  # it goes on after a failed request
            assert (again["BIG"] == 5.0).all()
        finally:
            await worker.stop(10)

    asyncio.run(scenario())


def test_a_large_output_is_copied_out_in_a_thread(tmp_path: Path) -> None:
    """An output too large to copy on the event loop reaches the callback copied all the
    same (later: a thread copies it), and its output-arena space goes back: the six
    replies held here are more than the arena (256 MiB) holds."""

    async def scenario() -> None:
        worker = await spawn_worker("two_sizes_0", True, None)
        try:
            await worker.load(_load(tmp_path, LARGE), 30)
            replies = [await _run(worker, float(x)) for x in range(6)]
            for x, reply in enumerate(replies):  # none is a view the next one overwrote
                assert isinstance(reply, WorkerReply)
                assert reply.held == [] and reply.worker is None
                outputs = _outputs(reply)
                assert outputs["SMALL"].tolist() == [2.0 * x]
                assert outputs["BIG"].size == LARGE and (outputs["BIG"] == x).all()
            held = await _run(worker, 7.0, keep=True)  # kept: viewed in place, however large
            assert isinstance(held, WorkerReply) and len(held.held) == 1
            assert (_outputs(held)["BIG"] == 7.0).all()
            worker.release_outputs(held.held)
        finally:
            await worker.stop(10)

    asyncio.run(scenario())


def test_every_frame_a_worker_sends_has_a_handler() -> None:
    async def scenario() -> None:
        worker = WorkerHandle("unstarted", ThreadLauncher())
        try:
            handled = set(worker._handlers)
        finally:
            worker.release_resources()
        assert handled == set(typing.get_args(m.WorkerToServer))

    asyncio.run(scenario())
