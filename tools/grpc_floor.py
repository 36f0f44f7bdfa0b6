"""The gRPC floor of a machine: an empty ModelInfer, answered at once, no model, no core.

A grpc-python client (as tritonclient.grpc uses) calls a server that answers with an empty
ModelInferResponse: a synchronous grpc-python server (thread pool), grpc.aio, and dlserve's
own HTTP/2 server (``server/transport``, what dlserve serves gRPC with). Whatever a server
does per request comes on top of this.
The servers run in a thread of this process: compare them with each other.

    python tools/grpc_floor.py [--requests N]
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
from concurrent import futures
from typing import Any

import grpc
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pbg


class _Sync(pbg.GRPCInferenceServiceServicer):  # type: ignore[misc]
    def ModelInfer(self, request: Any, context: Any) -> Any:
        return pb.ModelInferResponse(model_name=request.model_name)


class _Aio(pbg.GRPCInferenceServiceServicer):  # type: ignore[misc]
    async def ModelInfer(self, request: Any, context: Any) -> Any:
        return pb.ModelInferResponse(model_name=request.model_name)


def call(port: int, requests: int) -> tuple[float, float]:
    """p50 and p99 in microseconds of back-to-back calls after a warm-up."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pbg.GRPCInferenceServiceStub(channel)
        request = pb.ModelInferRequest(model_name="x")
        for _ in range(300):
            stub.ModelInfer(request)
        latencies = []
        for _ in range(requests):
            start = time.perf_counter()
            stub.ModelInfer(request)
            latencies.append(time.perf_counter() - start)
    latencies.sort()
    return latencies[len(latencies) // 2] * 1e6, latencies[int(len(latencies) * 0.99)] * 1e6


def sync_server(threads: int, requests: int) -> tuple[float, float]:
    server = grpc.server(futures.ThreadPoolExecutor(threads))
    pbg.add_GRPCInferenceServiceServicer_to_server(_Sync(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        return call(port, requests)
    finally:
        server.stop(0)


def aio_server(requests: int) -> tuple[float, float]:
    ready, stop = threading.Event(), threading.Event()
    ports: list[int] = []

    async def serve() -> None:
        server = grpc.aio.server()
        pbg.add_GRPCInferenceServiceServicer_to_server(_Aio(), server)
        ports.append(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.05)
        await server.stop(0)

    thread = threading.Thread(target=lambda: asyncio.run(serve()))
    thread.start()
    ready.wait()
    try:
        return call(ports[0], requests)
    finally:
        stop.set()
        thread.join()


def dlserve_server(requests: int) -> tuple[float, float]:
    import uvloop

    from dlserve.server.transport.grpc.calls import Method
    from dlserve.server.transport.grpc.listener import GrpcServer

    async def infer(request: Any, context: Any) -> Any:
        return pb.ModelInferResponse(model_name=request.model_name)

    path = "/inference.GRPCInferenceService/ModelInfer"
    method = Method(infer, deserialize=pb.ModelInferRequest.FromString,
                    serialize=pb.ModelInferResponse.SerializeToString)  # fmt: skip
    loop = uvloop.new_event_loop()
    server = GrpcServer({path: method}, "127.0.0.1", 0)
    port = loop.run_until_complete(server.start())
    thread = threading.Thread(target=loop.run_forever)
    thread.start()
    try:
        return call(port, requests)
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=3000)
    args = parser.parse_args()
    print(f"grpc {grpc.__version__}, {args.requests} requests, p50 / p99 us")
    print("sync server, 1 thread:  {:.0f} / {:.0f}".format(*sync_server(1, args.requests)))
    print("sync server, 8 threads: {:.0f} / {:.0f}".format(*sync_server(8, args.requests)))
    print("grpc.aio server:        {:.0f} / {:.0f}".format(*aio_server(args.requests)))
    print("dlserve's server:       {:.0f} / {:.0f}".format(*dlserve_server(args.requests)))


if __name__ == "__main__":
    main()
