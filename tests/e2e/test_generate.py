"""Triton's generate extension over HTTP: ``.../generate`` and ``.../generate_stream``.

A real server, plain HTTP from the standard library (tritonclient has no generate call):
inputs from JSON keys (scalars and flat lists, spread over the model's dims, BYTES as
strings), other keys and the "parameters" object as request parameters, outputs as flat
values; a decoupled model through /generate (one response, or Triton's error) and through
/generate_stream (server-sent events, an error event in the middle of a stream, the status
of a stream that fails at once); errors before inference with their statuses; a client
that goes away in the middle of a stream stops its request.
"""

from __future__ import annotations

import http.client
import json
import shutil
from collections.abc import Iterator
from typing import Any

import pytest

from conftest import EXAMPLES, TEST_MODELS, RunningServer, run_server

ONE_RESPONSE = (
    "generate expects model to produce exactly 1 response, use generate stream for model "
    "that generates various number of responses"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    repository = tmp_path_factory.mktemp("generate_repo")
    for source in (EXAMPLES / "add_sub", EXAMPLES / "identity_bytes", TEST_MODELS / "repeat",
                   TEST_MODELS / "raises"):  # fmt: skip
        shutil.copytree(source, repository / source.name)
    with run_server(repository) as running:
        yield running


def post(
    server: RunningServer, path: str, body: object, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    try:
        connection.request("POST", path, data, {"Content-Type": "application/json",
                                                **(headers or {})})  # fmt: skip
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


def generate(server: RunningServer, model: str, body: object) -> tuple[int, Any]:
    status, _, raw = post(server, f"/v2/models/{model}/generate", body)
    return status, json.loads(raw)


def events(raw: bytes) -> list[Any]:
    """The JSON of each server-sent event (``data: ...`` and a blank line)."""
    chunks = raw.decode().split("\n\n")
    assert chunks[-1] == ""  # every event ends with a blank line
    found = []
    for chunk in chunks[:-1]:
        assert chunk.startswith("data: "), chunk
        found.append(json.loads(chunk.removeprefix("data: ")))
    return found


def test_inputs_from_keys_outputs_as_values(server: RunningServer) -> None:
    status, body = generate(server, "add_sub", {"INPUT0": [1, 2, 3], "INPUT1": [1, 1, 1]})
    assert status == 200
    assert body == {"model_name": "add_sub", "model_version": "1",
                    "OUTPUT0": [2.0, 3.0, 4.0], "OUTPUT1": [0.0, 1.0, 2.0]}  # fmt: skip
    status, body = generate(server, "add_sub", {"INPUT0": 2.5, "INPUT1": 1})  # scalars: [1]
    assert status == 200 and body["OUTPUT0"] == 3.5 and body["OUTPUT1"] == 1.5
    status, _, raw = post(server, "/v2/models/add_sub/versions/1/generate",
                          {"INPUT0": [1], "INPUT1": [2]})  # fmt: skip
    assert status == 200 and json.loads(raw)["OUTPUT0"] == 3.0


def test_text_in_and_out(server: RunningServer) -> None:
    status, body = generate(server, "identity_bytes", {"INPUT0": "héllo wörld"})
    assert (status, body["OUTPUT0"]) == (200, "héllo wörld")
    status, body = generate(server, "identity_bytes", {"INPUT0": ["a", "", "c"]})
    assert (status, body["OUTPUT0"]) == (200, ["a", "", "c"])


def test_one_response_from_a_decoupled_model(server: RunningServer) -> None:
    status, body = generate(server, "repeat", {"COUNT": 1})
    assert status == 200 and body == {"model_name": "repeat", "model_version": "1", "INDEX": 0}
    status, body = generate(server, "repeat", {"COUNT": 3})
    assert (status, body) == (400, {"error": ONE_RESPONSE})
    status, body = generate(server, "repeat", {"COUNT": 0})  # only a final flag
    assert (status, body) == (400, {"error": ONE_RESPONSE})


def test_a_stream_of_events(server: RunningServer) -> None:
    status, headers, raw = post(server, "/v2/models/repeat/generate_stream", {"COUNT": 4})
    assert status == 200
    assert headers["content-type"] == "text/event-stream; charset=utf-8"
    assert [event["INDEX"] for event in events(raw)] == [0, 1, 2, 3]
    status, _, raw = post(server, "/v2/models/add_sub/generate_stream",
                          {"INPUT0": [1], "INPUT1": [2]})  # fmt: skip
    assert status == 200 and [e["OUTPUT0"] for e in events(raw)] == [3.0]  # not decoupled


def test_other_keys_and_the_parameters_object_are_parameters(server: RunningServer) -> None:
    """repeat's "fail_at" parameter turns that response into an error: the error is an
    event and the stream goes on, whether the key is top-level or in "parameters"."""
    for body in ({"COUNT": 3, "fail_at": 1}, {"COUNT": 3, "parameters": {"fail_at": 1}}):
        status, _, raw = post(server, "/v2/models/repeat/generate_stream", body)
        assert status == 200
        assert events(raw) == [
            {"model_name": "repeat", "model_version": "1", "INDEX": 0},
            {"error": "repeat: response 1 failed on purpose"},
            {"model_name": "repeat", "model_version": "1", "INDEX": 2},
        ]


def test_a_stream_that_fails_first_has_the_error_status(server: RunningServer) -> None:
    status, _, raw = post(server, "/v2/models/raises/generate_stream", {"INPUT0": [1.0]})
    assert status == 400
    (event,) = events(raw)
    assert "raises: execute failed on purpose" in event["error"]
    status, body = generate(server, "raises", {"INPUT0": [1.0]})
    assert status == 400 and body["error"] == event["error"]


def test_a_stream_whose_request_is_refused_gets_a_json_error(server: RunningServer) -> None:
    """As Triton answers a request it cannot issue: before any stream, with JSON."""
    status, headers, raw = post(server, "/v2/models/add_sub/generate_stream", {"INPUT0": [1]})
    assert status == 400 and headers["content-type"] == "application/json"
    assert "missing required input(s) ['INPUT1']" in json.loads(raw)["error"]


@pytest.mark.parametrize(
    ("model", "body", "status", "message"),
    [
        ("nope", {}, 404, "Request for unknown model: 'nope' is not found"),
        ("add_sub", b"not json", 400, "failed to parse the generate request JSON"),
        ("add_sub", b"[1, 2]", 400, "the generate request must be a JSON object"),
        ("repeat", {"COUNT": [1, 2]}, 400, "The schema can not convert input 'COUNT'"),
        ("add_sub", {"INPUT0": [[1]], "INPUT1": [1]}, 400, "must be a scalar or a flat list"),
        ("add_sub", {"INPUT0": [1], "INPUT1": [1], "x": [1]}, 400, "neither an input"),
        ("add_sub", {"INPUT0": ["a"], "INPUT1": [1]}, 400, "FP32 expects numbers"),
        ("add_sub", {"INPUT0": [1], "parameters": 3}, 400, "Expected JSON object"),
        ("add_sub", {"INPUT0": [1]}, 400, "missing required input(s) ['INPUT1']"),
    ],
)
def test_bad_requests(
    server: RunningServer, model: str, body: object, status: int, message: str
) -> None:
    got, answer = generate(server, model, body)
    assert got == status
    assert message in answer["error"]


def test_compressed_bodies_are_refused(server: RunningServer) -> None:
    status, _, raw = post(server, "/v2/models/add_sub/generate", b"\x1f\x8b",
                          {"Content-Encoding": "gzip"})  # fmt: skip
    assert status == 400
    assert json.loads(raw) == {
        "error": "Unsupported content-encoding, only 'identity' is supported."
    }


def test_a_client_that_goes_away_stops_its_stream(server: RunningServer) -> None:
    """until_cancelled sends until is_cancelled(); the report waits for that to happen."""
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    connection.request("POST", "/v2/models/repeat/generate_stream",
                       json.dumps({"COUNT": 1, "until_cancelled": True}))  # fmt: skip
    response = connection.getresponse()
    assert response.status == 200
    first = response.fp.readline()  # the chunk size line, then the first event
    assert first.strip()
    assert b"data: " in response.fp.readline()
    connection.sock.close()  # gone, in the middle of the stream
    connection.close()
    status, body = generate(server, "repeat", {"COUNT": 1, "report": True})
    assert status == 200 and body["INDEX"] >= 1  # the model saw is_cancelled()
