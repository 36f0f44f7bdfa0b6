"""``Client``: one-call inference with tensors from anywhere, over tritonclient.

::

    from dlserve.client import Client

    with Client("localhost:8001") as client:          # gRPC; "http://..." or "unix:///..."
        out = client.infer("add_sub", {"INPUT0": a, "INPUT1": b})   # numpy, torch, cupy ...
        out["OUTPUT0"]                                  # numpy (or a GPU tensor if asked)

GPU inputs go through CUDA shared memory and large host inputs through system shared
memory when the server is on this host, from pools of regions registered once and reused.
Everything is unregistered and freed on ``close()``, at the end of a ``with`` block
(exception or not), when the client is garbage-collected, and at interpreter exit; if the
process is killed, the server reclaims its regions (and a later client removes its
leftover /dev/shm objects).
"""

from __future__ import annotations

import logging
import os
import threading
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

log = logging.getLogger("dlserve.client")


def _library(target: Target) -> Any:
    if target.protocol == "grpc":
        import tritonclient.grpc as lib
    else:
        import tritonclient.http as lib
    return lib


class _Connections:
    """tritonclient clients: one for gRPC (thread-safe), one per thread for HTTP (its
    connections are not). Closed with the Client, or by its finalizer."""

    def __init__(self, target: Target, lib: Any, verbose: bool) -> None:
        self.target = target
        self.lib = lib
        self.verbose = verbose
        self.made: list[Any] = []
        self._local = threading.local()
        self._lock = threading.Lock()

    def get(self) -> Any:
        api = getattr(self._local, "api", None)
        if api is None:
            if self.target.protocol == "grpc" and self.made:
                return self.made[0]
            kwargs = {"ssl": True} if self.target.ssl else {}
            api = self.lib.InferenceServerClient(self.target.url, verbose=self.verbose, **kwargs)
            with self._lock:
                self.made.append(api)
            self._local.api = api
        return api

    def close(self) -> None:
        with self._lock:
            made, self.made = self.made, []
        for api in made:
            try:
                api.close()
            except Exception:
                pass


def _release(connections: _Connections, pools: Pools) -> None:
    """Unregister and free every region, then close the connections (finalizer: holds no
    reference to the Client)."""
    if pools.pid != os.getpid():
        return  # a forked child: the regions are its parent's
    for pool in pools.all():
        for slot in pool.drain():
            _drop(connections, pool, slot)
    connections.close()


def _drop(connections: _Connections, pool: RegionPool, slot: Slot) -> None:
    try:
        if slot.registered:
            getattr(connections.get(), unregister_name(slot))(slot.name)
    except Exception as exc:  # the server is gone: it reclaims the region itself
        log.debug("could not unregister %s: %s", slot.name, exc)
    finally:
        pool.destroy(slot)


class Client:
    """A thread-safe inference client (see the module's docstring)."""

    def __init__(
        self, url: str = "localhost:8001", *, shared_memory: bool | None = None,
        shm_threshold: int = SHM_THRESHOLD, max_free_regions: int = 8, verbose: bool = False,
    ) -> None:  # fmt: skip
        """``shared_memory``: None uses it when the server is on this host; host inputs of
        at least ``shm_threshold`` bytes go through it; each pool keeps at most
        ``max_free_regions`` idle regions registered."""
        self.target = parse_url(url)
        use_shm = self.target.local if shared_memory is None else shared_memory
        self._lib = _library(self.target)
        self._connections = _Connections(self.target, self._lib, verbose)
        self._pools = Pools(max_free_regions)
        self._planner = Planner(self._lib, self.target, self._pools, use_shm, shm_threshold)
        self._layouts = LayoutCache()
        self._finalizer = weakref.finalize(self, _release, self._connections, self._pools)
        if use_shm:
            sweep_stale_objects()

    @property
    def api(self) -> Any:
        """The underlying tritonclient client (this thread's), for every other call."""
        return self._connections.get()

    def infer(
        self, model: str, inputs: Mapping[str, Any], outputs: OutputSpec = None, *,
        model_version: str = "", request_id: str = "", parameters: Mapping[str, Any] | None = None,
        timeout: float | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """Run ``model`` on ``inputs`` (name -> numpy / torch / cupy / DLPack tensor).

        ``outputs``: names (host results), or name -> device ("cpu", "cuda:N"); None: every
        output, on the host. Returns name -> numpy array, or a DLPack tensor on a GPU.
        ``timeout``: seconds the gRPC call may take (HTTP: the connection's own timeouts).
        """
        self._check_fork()
        api = self._connections.get()
        known = None
        if self._planner.use_shm:  # outputs of fixed size may come back through a region
            known = self._model_outputs(api, model, model_version)
        prepared = self._planner.prepare(inputs, outputs, known)
        try:
            if self._register(api, prepared):
                result = api.infer(
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
                _drop(self._connections, pool, slot)
        # The server refused shared memory: from now on tensors travel in the requests.
        return self.infer(
            model, inputs, outputs, model_version=model_version, request_id=request_id,
            parameters=parameters, timeout=timeout,
        )  # fmt: skip

    def _register(self, api: Any, prepared: Prepared) -> bool:
        """Register the call's new regions; False when the server refuses shared memory
        (then the client stops using it)."""
        try:
            for slot in prepared.fresh():
                name, args = register_args(slot)
                getattr(api, name)(*args, headers={PID_HEADER: str(os.getpid())})
                slot.registered = True
        except Exception as exc:
            if not refused(exc):
                raise
            self._planner.stop_using_shm(exc)
            return False
        return True

    def _model_outputs(self, api: Any, model: str, version: str) -> ModelOutputs:
        known = self._layouts.get(model, version)
        if known is None:
            grpc = self.target.protocol == "grpc"
            try:
                config = api.get_model_config(model, version, **({"as_json": True} if grpc else {}))
            except Exception:
                return UNKNOWN  # infer reports what is wrong with the model
            known = self._layouts.put(model, version, config, self.target.protocol)
        return known

    def registered_regions(self) -> int:
        """How many regions this client holds (idle or in use)."""
        return sum(len(pool) for pool in self._pools.all())

    def _check_fork(self) -> None:
        if self._pools.pid != os.getpid():  # forked: start afresh, leave the parent's alone
            self._finalizer.detach()
            self._connections = _Connections(self.target, self._lib, self._connections.verbose)
            self._pools = Pools(self._pools.max_free)
            self._planner.pools = self._pools
            self._finalizer = weakref.finalize(self, _release, self._connections, self._pools)

    def close(self) -> None:
        """Unregister and free every region, close the connections. Idempotent."""
        self._finalizer()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
