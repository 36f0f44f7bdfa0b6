"""gRPC's standard health checking protocol (``grpc.health.v1.Health``), as Triton serves it.

Kubernetes' gRPC probes and tools like grpc-health-probe call ``Check``; Triton answers
SERVING when the server is ready and NOT_SERVING otherwise, and does not implement
``Watch``. The two messages come from their .proto definition (grpc's
``src/proto/grpc/health/v1/health.proto``), built here with protobuf's own descriptor
machinery: tritonclient does not ship them, and they are too small to need a package.
"""

from __future__ import annotations

from typing import Any, Final

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

SERVICE: Final = "grpc.health.v1.Health"
SERVING, NOT_SERVING = 1, 2  # HealthCheckResponse.ServingStatus


def _messages() -> tuple[Any, Any]:
    proto = descriptor_pb2.FileDescriptorProto(
        name="dlserve/grpc/health/v1/health.proto", package="grpc.health.v1", syntax="proto3"
    )
    field = descriptor_pb2.FieldDescriptorProto
    request = proto.message_type.add(name="HealthCheckRequest")
    request.field.add(name="service", number=1, type=field.TYPE_STRING, label=field.LABEL_OPTIONAL)
    response = proto.message_type.add(name="HealthCheckResponse")
    status = response.enum_type.add(name="ServingStatus")
    for number, name in enumerate(("UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN")):
        status.value.add(name=name, number=number)
    response.field.add(
        name="status", number=1, type=field.TYPE_ENUM, label=field.LABEL_OPTIONAL,
        type_name=".grpc.health.v1.HealthCheckResponse.ServingStatus",
    )  # fmt: skip
    pool = descriptor_pool.DescriptorPool()  # its own: no clash with another copy of it
    pool.Add(proto)
    find = pool.FindMessageTypeByName
    return (
        message_factory.GetMessageClass(find("grpc.health.v1.HealthCheckRequest")),
        message_factory.GetMessageClass(find("grpc.health.v1.HealthCheckResponse")),
    )


HealthCheckRequest, HealthCheckResponse = _messages()


def check_response(ready: bool) -> Any:
    return HealthCheckResponse(status=SERVING if ready else NOT_SERVING)
