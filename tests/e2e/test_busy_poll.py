"""Polling: ``--busy-poll-us`` (workers and the server poll instead of sleeping),
``--reply-poll-us`` (the server polls a while for a reply) and ``--request-poll-us`` (a
worker polls a while for its next request), the last two on by default and 0 turning them
off: answers stay right either way, the workers get the time they are to poll, and a bad
value is refused."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient

from conftest import EXAMPLES, run_server


@pytest.mark.parametrize(
    "flags",
    [
        ("--busy-poll-us", "300"),
        ("--reply-poll-us", "0"),
        ("--reply-poll-us", "50"),
        ("--request-poll-us", "0"),
        ("--request-poll-us", "50"),
    ],
    ids=["busy-poll", "no-reply-poll", "short-reply-poll", "no-request-poll", "short-request-poll"],
)
def test_a_polling_server_answers_correctly(flags: tuple[str, str]) -> None:
    with run_server(EXAMPLES, *flags) as server:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        for n in range(20):
            a = np.full(16, n, np.float32)
            b = np.arange(16, dtype=np.float32)
            inputs = [grpcclient.InferInput("INPUT0", [16], "FP32"),
                      grpcclient.InferInput("INPUT1", [16], "FP32")]  # fmt: skip
            inputs[0].set_data_from_numpy(a)
            inputs[1].set_data_from_numpy(b)
            result = client.infer("add_sub", inputs)
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
            np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
        client.close()


@pytest.mark.parametrize(
    ("flags", "polled"),
    [
        ((), "2000"),
        (("--request-poll-us", "0"), "0"),
        (("--request-poll-us", "700", "--busy-poll-us", "300"), "700"),
        (("--request-poll-us", "700", "--busy-poll-us", "3000"), "3000"),
    ],
    ids=["default", "off", "request-poll", "busy-poll-longer"],
)
def test_workers_poll_for_requests_as_long_as_the_options_say(
    flags: tuple[str, ...], polled: str
) -> None:
    """The longer of --request-poll-us and --busy-poll-us reaches each worker process."""
    with run_server(EXAMPLES, "--load-model", "add_sub", "--model-control-mode", "explicit",
                    *flags) as server:  # fmt: skip
        workers = [p.cmdline() for p in psutil.Process(server.process.pid).children()
                   if "dlserve.worker.main" in p.cmdline()]  # fmt: skip
        assert workers
        for command in workers:
            assert command[command.index("--poll-us") + 1] == polled


@pytest.mark.parametrize("flag", ["--busy-poll-us", "--reply-poll-us", "--request-poll-us"])
def test_a_negative_polling_time_is_refused(flag: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "dlserve", "serve", "--model-repository", str(EXAMPLES), flag, "-1"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert f"{flag}: must be >= 0" in done.stderr
