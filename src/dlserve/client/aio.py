"""``AsyncClient``: :class:`dlserve.client.Client` for asyncio (tritonclient's aio clients).

::

    async with AsyncClient("localhost:8001") as client:
        out = await client.infer("add_sub", {"INPUT0": a, "INPUT1": b})

Concurrent ``infer`` calls each take their own regions from the pools. ``aclose()`` (or the
end of the ``async with``) unregisters and frees everything; if the client is dropped
unclosed, its finalizer does it at garbage collection or interpreter exit through a
blocking tritonclient client.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Mapping
from types import TracebackType
from typing import Any

from dlserve.client._outputs import UNKNOWN, LayoutCache, ModelOutputs
from dlserve.client._pool import RegionPool, Slot
from dlserve.client._request import (
    PID_HEADER,
    SHM_THRESHOLD,
    OutputSpec,
    Planner,
    Pools,
    Prepared,
    Target,
    parse_url,
    refused,
    register_args,
    sweep_stale_objects,
    unregister_name,
)
from dlserve.client.client import _Connections, _library, _release

log = logging.getLogger("dlserve.client")


def _aio_library(target: Target) -> Any:
    if target.protocol == "grpc":
        import tritonclient.grpc.aio as lib
    else:
        import tritonclient.http.aio as lib
    return lib


class AsyncClient:
    """An asyncio inference client; see :class:`dlserve.client.Client` for the arguments."""

    def __init__(
        self, url: str = "localhost:8001", *, shared_memory: bool | None = None,
        shm_threshold: int = SHM_THRESHOLD, max_free_regions: int = 8, verbose: bool = False,
    ) -> None:  # fmt: skip
        self.target = parse_url(url)
        use_shm = self.target.local if shared_memory is None else shared_memory
        lib = _aio_library(self.target)
        kwargs = {"ssl": True} if self.target.ssl else {}
        self.api: Any = lib.InferenceServerClient(self.target.url, verbose=verbose, **kwargs)
        self._pools = Pools(max_free_regions)
        self._planner = Planner(lib, self.target, self._pools, use_shm, shm_threshold)
        self._layouts = LayoutCache()
        # Unclosed at collection or exit: a blocking client unregisters what is left.
        blocking = _Connections(self.target, _library(self.target), verbose)
        self._finalizer = weakref.finalize(self, _release, blocking, self._pools)
        if use_shm:
            sweep_stale_objects()

    async def infer(
        self, model: str, inputs: Mapping[str, Any], outputs: OutputSpec = None, *,
        model_version: str = "", request_id: str = "", parameters: Mapping[str, Any] | None = None,
        timeout: float | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """As :meth:`dlserve.client.Client.infer`."""
        known = None
        if self._planner.use_shm:  # outputs of fixed size may come back through a region
            known = await self._model_outputs(model, model_version)
        prepared = self._planner.prepare(inputs, outputs, known)
        try:
            if await self._register(prepared):
                result = await self.api.infer(
                    model, prepared.inputs, model_version=model_version,
                    outputs=prepared.outputs, request_id=request_id,
                    parameters=dict(parameters) if parameters else None,
                    **self._planner.timeout(timeout),
                )  # fmt: skip
                return self._planner.results(result, prepared)
        except BaseException:
            self._layouts.forget(model, model_version)  # the model may have changed
            raise
        finally:
            for pool, slot in self._planner.give_back(prepared):
                await self._drop(pool, slot)
        # The server refused shared memory: from now on tensors travel in the requests.
        return await self.infer(
            model, inputs, outputs, model_version=model_version, request_id=request_id,
            parameters=parameters, timeout=timeout,
        )  # fmt: skip

    async def _register(self, prepared: Prepared) -> bool:
        try:
            for slot in prepared.fresh():
                name, args = register_args(slot)
                await getattr(self.api, name)(*args, headers={PID_HEADER: str(os.getpid())})
                slot.registered = True
        except Exception as exc:
            if not refused(exc):
                raise
            self._planner.stop_using_shm(exc)
            return False
        return True

    async def _model_outputs(self, model: str, version: str) -> ModelOutputs:
        known = self._layouts.get(model, version)
        if known is None:
            grpc = self.target.protocol == "grpc"
            try:
                kwargs = {"as_json": True} if grpc else {}
                config = await self.api.get_model_config(model, version, **kwargs)
            except Exception:
                return UNKNOWN  # infer reports what is wrong with the model
            known = self._layouts.put(model, version, config, self.target.protocol)
        return known

    async def _drop(self, pool: RegionPool, slot: Slot) -> None:
        try:
            if slot.registered:
                await getattr(self.api, unregister_name(slot))(slot.name)
        except Exception as exc:  # the server is gone: it reclaims the region itself
            log.debug("could not unregister %s: %s", slot.name, exc)
        finally:
            pool.destroy(slot)

    def registered_regions(self) -> int:
        return sum(len(pool) for pool in self._pools.all())

    async def aclose(self) -> None:
        """Unregister and free every region, close the connection. Idempotent."""
        if not self._finalizer.alive:
            return
        self._finalizer.detach()
        for pool in self._pools.all():
            for slot in pool.drain():
                await self._drop(pool, slot)
        await self.api.close()

    async def close(self) -> None:
        """As :meth:`aclose` (tritonclient's aio clients name it so)."""
        await self.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()
