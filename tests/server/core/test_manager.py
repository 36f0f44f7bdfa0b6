"""The model manager, driven through the service's repository API in one process: load,
reload (the loaded model serves until the new one is ready; a reload that fails leaves it
serving), and unload (what was accepted finishes first).

tests/models/generation answers with its config's "generation" parameter, so a test sees
which config served a request; its config's gate parameters hold its initialize.
"""

from __future__ import annotations

import numpy as np
import pytest

from dlserve import errors
from dlserve.server.core.models.versions import UNLOADED
from dlserve.server.core.service import InferenceService
from dlserve.types import InferRequest, ModelState, ParamValue, RepositoryEntry

from .harness import Core, Gate, in_flight, output, pending, request, scalars, tensor, until


def configure(core: Core, generation: str, gate: Gate | None = None, fail: bool = False) -> None:
    """Rewrite the generation model's config: its generation, and what its initialize does."""
    config = core.config("generation")
    lines = [line for line in config.read_text().splitlines() if not line.startswith("parameters")]
    parameters = {"generation": generation, **(gate.parameters if gate is not None else {})}
    if fail:
        parameters["fail"] = "yes"
    for key, value in parameters.items():
        lines.append(f'parameters {{ key: "{key}" value {{ string_value: "{value}" }} }}')
    config.write_text("\n".join(lines) + "\n")


async def generation(service: InferenceService) -> str:
    """The generation that answers a request now."""
    response = await service.infer(request("generation", tensor("INPUT0", [1.0], "FP32")))
    np.testing.assert_array_equal(output(response, "OUTPUT0"), [1.0])
    answer = output(response, "GENERATION")[0]
    assert isinstance(answer, bytes), answer
    return answer.decode()


def entry(service: InferenceService, name: str) -> RepositoryEntry:
    (found,) = [e for e in service.repository_api.index() if e.name == name]
    return found


async def test_a_model_is_loaded_and_unloaded_on_request(core: Core) -> None:
    core.add("generation")
    async with core.serving() as service:
        assert entry(service, "generation").state is None  # in the repository, never loaded
        with pytest.raises(errors.NotFoundError, match="'generation' is not found"):
            await generation(service)
        await service.repository_api.load("generation")
        assert entry(service, "generation") == RepositoryEntry(
            "generation", "1", ModelState.READY, ""
        )
        assert await generation(service) == "first"
        await service.repository_api.unload("generation")
        assert not service.model_ready("generation")
        assert entry(service, "generation").state is ModelState.UNAVAILABLE
        assert entry(service, "generation").reason == UNLOADED
        with pytest.raises(errors.UnavailableError, match="has no available versions"):
            await generation(service)


async def test_a_reloaded_model_serves_until_its_new_instances_are_ready(core: Core) -> None:
    async with core.serving("generation") as service:
        assert await generation(service) == "first"
        gate = core.gate()
        configure(core, "second", gate)
        reload = in_flight(service.repository_api.load("generation"))
        await gate.started()  # the new instance is in its initialize
        assert await generation(service) == "first"
        assert service.model_ready("generation")
        assert entry(service, "generation").state is ModelState.READY
        await gate.open()
        await reload
        assert await generation(service) == "second"


async def test_a_reload_that_fails_leaves_the_loaded_model_serving(core: Core) -> None:
    async with core.serving("generation") as service:
        configure(core, "second", fail=True)
        with pytest.raises(errors.UnavailableError, match="generation second fails to start"):
            await service.repository_api.load("generation")
        assert await generation(service) == "first"
        assert entry(service, "generation") == RepositoryEntry(
            "generation", "1", ModelState.READY, ""
        )
        configure(core, "third")  # and the next reload takes
        await service.repository_api.load("generation")
        assert await generation(service) == "third"


async def test_unload_lets_accepted_requests_finish_and_refuses_new_ones(core: Core) -> None:
    """One request runs (held), one waits at the instance, one in the queue: unloading
    waits for all three, which run as they would have; a request that comes meanwhile is
    refused."""
    async with core.serving("serial") as service:
        gate = core.gate()

        def serial(value: float, **parameters: ParamValue) -> InferRequest:
            return request("serial", tensor("INPUT0", [value], "FP32"), **parameters)

        accepted = [in_flight(service.infer(serial(0.5, **gate.parameters)))]
        await gate.started()
        accepted += [in_flight(service.infer(serial(float(i)))) for i in (1, 2)]
        await until(lambda: pending(service, "serial") == 2, "two requests pending")
        unload = in_flight(service.repository_api.unload("serial"))
        await until(lambda: entry(service, "serial").state is ModelState.UNLOADING, "unloading")
        with pytest.raises(errors.DlserveError, match=r"^Request for unknown model: 'serial'"):
            await service.infer(serial(3.0))
        assert not unload.done()
        await gate.open()
        executions = [scalars(await task, ["EXECUTION"])["EXECUTION"] for task in accepted]
        assert executions == [1, 2, 3]
        await unload
        assert entry(service, "serial").state is ModelState.UNAVAILABLE
        assert not service.model_ready("serial")
