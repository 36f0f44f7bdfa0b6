"""async_waiter: a decoupled model whose ``async def execute`` awaits, then answers.

Request parameters, in this order: ``wait_s`` (seconds to ``asyncio.sleep``), ``callee``
(a model to call through BLS ``async_exec`` with this request's IN and ``callee_wait_s``
as its ``wait_s``; ``callee_decoupled``: the callee is decoupled), ``fail`` (raise
instead of answering), ``returns`` (return a response list instead of None), ``later``
(answer with that many responses from a task that runs after execute has returned).
The answer is OUT = IN (the callee's OUT after a BLS call), with the final flag.
"""

import asyncio
import json

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def out(value):
    return pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.asarray(value, np.int32))])


class TritonPythonModel:
    def initialize(self, args):
        self.tasks = set()  # asyncio keeps only weak references to tasks

    async def execute(self, requests):
        running = asyncio.current_task()  # this execute's own task
        await asyncio.gather(*(self.answer(request, running) for request in requests))
        if any(json.loads(r.parameters()).get("returns") for r in requests):
            return [out([0]) for _ in requests]
        return None

    async def answer(self, request, running):
        params = json.loads(request.parameters())
        value = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
        sender = request.get_response_sender()
        await asyncio.sleep(float(params.get("wait_s", 0)))
        if "callee" in params:
            value = await self.call(params, value)
        if params.get("fail"):
            raise ValueError(f"async_waiter: request {int(value[0])} failed on purpose")
        if params.get("returns"):
            return
        if params.get("later"):
            later = self.send_later(running, sender, value, int(params["later"]))
            task = asyncio.create_task(later)
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
            return
        sender.send(out(value), flags=FINAL)

    async def call(self, params, value):
        decoupled = bool(params.get("callee_decoupled"))
        call = pb_utils.InferenceRequest(
            model_name=params["callee"],
            inputs=[pb_utils.Tensor("IN", value)],
            requested_output_names=["OUT"],
            parameters={"wait_s": params.get("callee_wait_s", 0)},
        )
        answer = await call.async_exec(decoupled=decoupled)
        responses = [r for r in answer if r.output_tensors()] if decoupled else [answer]
        if responses[0].has_error():
            raise pb_utils.TritonModelException(responses[0].error().message())
        return pb_utils.get_output_tensor_by_name(responses[0], "OUT").as_numpy()

    async def send_later(self, execute, sender, value, count):
        await asyncio.wait({execute})  # until the execute that started this task returns
        for index in range(count):
            sender.send(out(value + index))
            await asyncio.sleep(0)
        sender.send(flags=FINAL)
