"""Names given to pb_utils as bytes, and frames no side can read, through a real server
driven by unmodified tritonclient, both ways a BLS call goes (straight to the callee's
instance, and with --bls-direct false through the server):

- a BLS model shaped as Triton's own example takes its callee's name from a BYTES input
  (``as_numpy()[0]`` is bytes), with ``exec`` and with ``async_exec``, and with every
  other name as bytes too;
- a frame that cannot be read (a reply, a BLS call, garbage, a direct call's answer or
  request) fails only the request or call it belongs to, with an error that names the
  model; the same instances (the same processes) serve the next requests.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import TEST_MODELS, RunningServer, repository_of, run_server

MODELS = ("bls_by_name", "double", "bad_frame", "bad_callee")


@pytest.fixture(scope="module", params=["true", "false"], ids=["direct", "through-server"])
def server(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[RunningServer]:
    models = (TEST_MODELS / name for name in MODELS)
    repository = repository_of(tmp_path_factory.mktemp("names_repo"), *models)
    with run_server(repository, "--bls-direct", request.param) as running:
        yield running


@pytest.fixture
def client(server: RunningServer) -> Iterator[grpcclient.InferenceServerClient]:
    with grpcclient.InferenceServerClient(server.grpc_url) as triton:
        yield triton


def direct(server: RunningServer) -> bool:
    return "true" in server.process.args  # type: ignore[operator]


def fp32(values: np.ndarray) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput("INPUT0", list(values.shape), "FP32")
    tensor.set_data_from_numpy(values.astype(np.float32))
    return tensor


@pytest.mark.parametrize("mode", ["sync", "async", "bytes"])
def test_bls_callee_named_by_a_bytes_input(
    server: RunningServer, client: grpcclient.InferenceServerClient, mode: str
) -> None:
    name = grpcclient.InferInput("MODEL_NAME", [1], "BYTES")
    name.set_data_from_numpy(np.array([b"double"], dtype=np.object_))
    x = np.array([1.5, -2.0, 4.0], dtype=np.float32)
    for _ in range(2):  # the first call opens the direct connection, the second uses it
        result = client.infer("bls_by_name", [name, fp32(x)], parameters={"mode": mode})
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x * 2)
        assert result.as_numpy("DIRECT").tolist() == [direct(server)]


def test_bls_callee_named_by_a_bytes_input_over_http(server: RunningServer) -> None:
    with httpclient.InferenceServerClient(server.http_url) as http:
        name = httpclient.InferInput("MODEL_NAME", [1], "BYTES")
        name.set_data_from_numpy(np.array([b"double"], dtype=np.object_))
        x = httpclient.InferInput("INPUT0", [2], "FP32")
        x.set_data_from_numpy(np.array([3, 4], dtype=np.float32))
        result = http.infer("bls_by_name", [name, x], parameters={"mode": "async"})
        assert result.as_numpy("OUTPUT0").tolist() == [6, 8]


def bad_frame(
    client: grpcclient.InferenceServerClient, mode: str, size: int = 2
) -> tuple[list[int], str]:  # fmt: skip
    """bad_frame's (pids of itself and bad_callee, error text) for ``mode``; none of its
    output arena is held when it begins (earlier replies' space was given back)."""
    x = np.arange(size, dtype=np.float32)
    result = client.infer("bad_frame", [fp32(x)], parameters={"mode": mode})
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x)
    assert result.as_numpy("HELD").tolist() == [0, 0]
    return result.as_numpy("PIDS").tolist(), result.as_numpy("ERROR")[0].decode()


@pytest.mark.parametrize("size", [2, 1 << 22])  # large: the output is in the output arena
def test_an_unreadable_reply_fails_its_request_only(
    client: grpcclient.InferenceServerClient, size: int
) -> None:
    """The reply's output name is bytes: the server fails that request with an error
    naming the model and the cause, and keeps the channel and the instance."""
    pids, _ = bad_frame(client, "ok")
    with pytest.raises(InferenceServerException) as raised:
        bad_frame(client, "reply", size)
    message = raised.value.message()
    assert "model 'bad_frame' (instance 'bad_frame_0_0') sent a frame (InferDone) " in message
    assert "that cannot be read: Expected `str`, got `bytes`" in message
    assert bad_frame(client, "ok") == (pids, "")  # the same processes serve on


@pytest.mark.parametrize("size", [2, 1 << 22])
def test_a_reply_that_cannot_be_encoded_fails_its_request_only(
    client: grpcclient.InferenceServerClient, size: int
) -> None:
    """An exception's message with no UTF-8 form goes with a replacement character; a
    reply that still cannot be encoded goes as its request's error (its memory given back
    in the worker)."""
    pids, _ = bad_frame(client, "ok")
    with pytest.raises(InferenceServerException) as raised:
        bad_frame(client, "raise")
    assert "no ? text" in raised.value.message()
    with pytest.raises(InferenceServerException) as raised:
        bad_frame(client, "unsendable", size)
    assert raised.value.message() == (
        "the response of model 'bad_frame' cannot be sent: 'utf-8' codec can't "
        "encode character '\\udc80' in position 8: surrogates not allowed"
    )
    assert bad_frame(client, "ok") == (pids, "")


@pytest.mark.parametrize(
    ("mode", "size"),
    [("call", 2), ("garbage", 2), ("direct_reply", 2), ("direct_reply", 1 << 22),
     ("direct_request", 2)],
)  # fmt: skip
def test_an_unreadable_frame_fails_one_call_and_the_instances_serve_on(
    server: RunningServer, client: grpcclient.InferenceServerClient, mode: str, size: int
) -> None:
    """direct_reply's large output is in the callee's output arena, lent to the caller."""
    if mode == "direct_request" and not direct(server):
        pytest.skip("a frame on a direct connection: there is none through the server")
    pids, _ = bad_frame(client, "ok")
    after, error = bad_frame(client, mode, size)
    assert after == pids
    expected = {
        # the server answers the call (the model's wait ends) with the error
        "call": "model 'bad_frame' (instance 'bad_frame_0_0') sent a frame (BlsCall) that "
        "cannot be read: Expected `str`, got `bytes`",
        # nothing can be failed for a frame that says nothing: dropped (and logged)
        "garbage": "",
        # the server (or the caller, directly) cannot read the callee's reply
        "direct_reply": "model 'bad_callee' (instance 'bad_callee_0_0') sent a frame (InferDone) "
        "that cannot be read: Expected `str`, got `bytes`",
        # the callee cannot read the caller's request: it answers with the error
        "direct_request": "a direct caller sent a frame (Infer) that cannot be read: Expected "
        "`str`, got `bytes`",
    }[mode]
    assert error.startswith(expected), error
    assert bad_frame(client, "ok") == (pids, "")
    assert server.alive()
