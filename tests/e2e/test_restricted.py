"""Restricted endpoint groups (``--grpc-restricted-protocol``, ``--http-restricted-api``)
against a real server, with unmodified tritonclient (and grpcio / http.client for the
membership table).

- model-repository restricted to ``admin-key=secret``: load, unload and index without
  the header, or with a wrong value, are refused with Triton's code and message; with it
  they work; inference and health work without it; gRPC and HTTP alike.
- several groups in one option; several options (one per group, each its own key): every
  gRPC method and HTTP route is refused with its own group's header named, and passes
  with it.
- header names match whatever their case.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import queue
import subprocess
import sys
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import EXAMPLES, RunningServer, run_server
from dlserve.server.frontends.restrictions import GROUPS, GRPC_METHOD_GROUPS, HTTP_ROUTE_GROUPS

ADMIN = {"triton-grpc-protocol-admin-key": "secret"}  # gRPC: Triton's header prefix
HTTP_ADMIN = {"admin-key": "secret"}
GRPC_REFUSED = "This protocol is restricted, expecting header 'triton-grpc-protocol-admin-key'"
HTTP_REFUSED = "This API is restricted, expecting header 'admin-key'"


@pytest.fixture(scope="module")
def admin_server() -> Iterator[RunningServer]:
    """model-repository and shared-memory (two groups in one option) need the admin key."""
    with run_server(
        EXAMPLES, "--model-control-mode", "explicit", "--load-model", "add_sub",
        "--grpc-restricted-protocol=model-repository,shared-memory:admin-key=secret",
        "--http-restricted-api=model-repository,shared-memory:admin-key=secret",
    ) as server:  # fmt: skip
        yield server


def _refused(call: object) -> InferenceServerException:
    assert callable(call)
    with pytest.raises(InferenceServerException) as caught:
        call()
    return caught.value


def _infer_inputs(module: object) -> list[object]:
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        tensor = module.InferInput(name, [4], "FP32")  # type: ignore[attr-defined]
        tensor.set_data_from_numpy(np.arange(4, dtype=np.float32))
        inputs.append(tensor)
    return inputs


# protocol -> (client module, the server's URL attribute, a wrong key, status, message)
REFUSALS = {
    "grpc": (grpcclient, "grpc_url", {"triton-grpc-protocol-admin-key": "wrong"},
             "StatusCode.UNAVAILABLE", GRPC_REFUSED),
    "http": (httpclient, "http_url", {"admin-key": "wrong"}, "403", HTTP_REFUSED),
}  # fmt: skip


@pytest.mark.parametrize("wrong", [False, True], ids=["no-header", "wrong-value"])
@pytest.mark.parametrize("protocol", sorted(REFUSALS))
def test_model_repository_is_refused_without_the_key(
    admin_server: RunningServer, protocol: str, wrong: bool
) -> None:
    module, url, wrong_key, status, message = REFUSALS[protocol]
    headers = wrong_key if wrong else None
    client = module.InferenceServerClient(getattr(admin_server, url))
    calls = {
        "load": lambda: client.load_model("double", headers=headers),
        "unload": lambda: client.unload_model("add_sub", headers=headers),
        "index": lambda: client.get_model_repository_index(headers=headers),
        "shm status": lambda: client.get_system_shared_memory_status(headers=headers),
    }
    for what, call in calls.items():
        refused = _refused(call)
        print(what, refused.status(), refused.message())
        assert refused.status() == status, what
        assert refused.message() == message, what
    assert client.is_model_ready("add_sub")  # nothing was unloaded
    assert not client.is_model_ready("double")  # nor loaded
    client.close()


def test_grpc_model_repository_works_with_the_key_and_the_rest_without(
    admin_server: RunningServer,
) -> None:
    client = grpcclient.InferenceServerClient(admin_server.grpc_url)
    assert client.is_server_live() and client.is_server_ready()
    assert client.get_server_metadata().name  # metadata: not restricted
    result = client.infer("add_sub", _infer_inputs(grpcclient))  # type: ignore[arg-type]
    assert result.as_numpy("OUTPUT0").tolist() == [0, 2, 4, 6]
    names = {m.name for m in client.get_model_repository_index(headers=ADMIN).models}
    assert {"add_sub", "double"} <= names
    client.load_model("double", headers=ADMIN)
    assert client.is_model_ready("double")
    client.unload_model("double", headers=ADMIN)
    assert not client.is_model_ready("double")
    assert client.get_system_shared_memory_status(headers=ADMIN).regions == {}
    client.close()


def test_http_model_repository_works_with_the_key_and_the_rest_without(
    admin_server: RunningServer,
) -> None:
    client = httpclient.InferenceServerClient(admin_server.http_url)
    assert client.is_server_live() and client.is_server_ready()
    assert client.get_server_metadata()["name"]
    result = client.infer("add_sub", _infer_inputs(httpclient))  # type: ignore[arg-type]
    assert result.as_numpy("OUTPUT0").tolist() == [0, 2, 4, 6]
    names = {m["name"] for m in client.get_model_repository_index(headers=HTTP_ADMIN)}
    assert {"add_sub", "double"} <= names
    client.load_model("double", headers={"Admin-Key": "secret"})  # any case of the name
    assert client.is_model_ready("double")
    client.unload_model("double", headers=HTTP_ADMIN)
    assert not client.is_model_ready("double")
    assert client.get_system_shared_memory_status(headers=HTTP_ADMIN) == []
    client.close()


def test_http_refuses_before_it_reads_the_body(admin_server: RunningServer) -> None:
    """A refused request's body is not looked at: a malformed one gets the 403, and the
    connection goes on serving."""
    connection = http.client.HTTPConnection(admin_server.http_url, timeout=30)
    connection.request("POST", "/v2/repository/models/double/load", body=b"{not json")
    response = connection.getresponse()
    assert (response.status, json.loads(response.read())) == (403, {"error": HTTP_REFUSED})
    connection.request("GET", "/v2/health/ready")
    assert connection.getresponse().status == 200
    connection.close()


# --- every group, each with its own key -----------------------------------------------


def _key(group: str) -> str:
    return f"{group}-key"


@pytest.fixture(scope="module")
def grouped_server() -> Iterator[RunningServer]:
    """Each group restricted by its own option: header '<group>-key', value '<group>'."""
    options = []
    for group in GROUPS:
        options += [f"--grpc-restricted-protocol={group}:{_key(group)}={group}",
                    f"--http-restricted-api={group}:{_key(group).upper()}={group}"]  # fmt: skip
    with run_server(
        EXAMPLES, "--model-control-mode", "explicit", "--load-model", "add_sub", *options
    ) as server:  # fmt: skip
        yield server


def _grpc_status(channel: grpc.Channel, path: str, metadata: list[tuple[str, str]]) -> grpc.Call:
    """Call ``path`` with an empty request message; its status (the call's outcome)."""
    if path.endswith("/ModelStreamInfer"):
        call = channel.stream_stream(path)(iter(()), metadata=metadata, timeout=30)
        try:
            list(call)
        except grpc.RpcError:
            pass
        return call  # type: ignore[no-any-return]
    try:
        _, call = channel.unary_unary(path).with_call(b"", metadata=metadata, timeout=30)
    except grpc.RpcError as error:
        return error  # type: ignore[return-value]
    return call  # type: ignore[no-any-return]


@pytest.mark.parametrize("path", sorted(GRPC_METHOD_GROUPS))
def test_each_grpc_method_belongs_to_its_group(grouped_server: RunningServer, path: str) -> None:
    group = GRPC_METHOD_GROUPS[path]
    header = f"triton-grpc-protocol-{_key(group)}"
    with grpc.insecure_channel(grouped_server.grpc_url) as channel:
        refused = _grpc_status(channel, path, [])
        print(path, refused.code(), refused.details())
        assert refused.code() == grpc.StatusCode.UNAVAILABLE
        assert refused.details() == f"This protocol is restricted, expecting header '{header}'"
        allowed = _grpc_status(channel, path, [(header, group)])
        assert "restricted" not in (allowed.details() or ""), allowed.details()


def _http_target(template: str) -> tuple[str, str]:
    model = "double" if "/repository/" in template else "add_sub"  # add_sub stays loaded
    path = template.replace(":version}", "}").format(model=model, version="1", region="r")
    last = path.rsplit("/", 1)[-1]
    post = last in {"infer", "generate", "generate_stream", "register", "unregister", "index",
                    "load", "unload"}  # fmt: skip
    return ("POST" if post else "GET"), path


@pytest.mark.parametrize("template", sorted(HTTP_ROUTE_GROUPS))
def test_each_http_route_belongs_to_its_group(grouped_server: RunningServer, template: str) -> None:
    group = HTTP_ROUTE_GROUPS[template]
    method, path = _http_target(template)
    connection = http.client.HTTPConnection(grouped_server.http_url, timeout=30)
    connection.request(method, path, body=b"{}")
    response = connection.getresponse()
    body = json.loads(response.read())
    print(method, path, response.status, body)
    assert response.status == 403
    assert body == {"error": f"This API is restricted, expecting header '{_key(group).upper()}'"}
    connection.request(method, path, body=b"{}", headers={_key(group): group})
    response = connection.getresponse()
    assert response.status != 403, response.read()
    response.read()
    connection.close()


def test_restricted_inference_over_tritonclient(grouped_server: RunningServer) -> None:
    """Streams and the HTTP infer fast path are restricted too; with the header they serve."""
    grpc_header = {"triton-grpc-protocol-inference-key": "inference"}
    results: queue.Queue[tuple[object, InferenceServerException | None]] = queue.Queue()
    client = grpcclient.InferenceServerClient(grouped_server.grpc_url)
    for headers in (None, grpc_header):
        client.start_stream(lambda result, error: results.put((result, error)), headers=headers)
        with contextlib.suppress(InferenceServerException):  # refused already: over
            client.async_stream_infer("add_sub", _infer_inputs(grpcclient))  # type: ignore[arg-type]
        result, error = results.get(timeout=30)
        client.stop_stream()
        if headers is None:
            assert error is not None and error.status() == "StatusCode.UNAVAILABLE"
            assert error.message() == (
                "This protocol is restricted, expecting header 'triton-grpc-protocol-inference-key'"
            )
        else:
            assert error is None
            assert result.as_numpy("OUTPUT1").tolist() == [0, 0, 0, 0]  # type: ignore[attr-defined]
    client.close()
    http_client = httpclient.InferenceServerClient(grouped_server.http_url)
    refused = _refused(lambda: http_client.infer("add_sub", _infer_inputs(httpclient)))  # type: ignore[arg-type]
    assert (refused.status(), refused.message()) == (
        "403", "This API is restricted, expecting header 'INFERENCE-KEY'",
    )  # fmt: skip
    served = http_client.infer(
        "add_sub",
        _infer_inputs(httpclient),
        headers={"inference-key": "inference"},  # type: ignore[arg-type]
    )
    assert served.as_numpy("OUTPUT0").tolist() == [0, 2, 4, 6]
    http_client.close()


def test_a_group_given_twice_stops_the_server_with_tritons_message() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "dlserve", "serve", "--model-repository", str(EXAMPLES),
         "--grpc-restricted-protocol=health,model-repository:a=b",
         "--grpc-restricted-protocol=model-repository:c=d"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    print(done.stderr.strip().splitlines()[-1])
    assert done.returncode != 0
    assert (
        "restricted protocol 'model-repository' can not be specified in multiple config groups"
        in done.stderr
    )
