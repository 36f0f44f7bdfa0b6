"""pb_utils.Logger: Triton's line format on stderr, with the caller's place and the model."""

from __future__ import annotations

import inspect
import os
import re
import socket

import pytest

from dlserve import pb_utils as pb_utils
from dlserve.ipc import codec
from dlserve.ipc.channel import BlockingChannel
from dlserve.ipc.log_environment import log_settings_env
from dlserve.worker.link import link

LINE = re.compile(r"^([IWE])(\d{4} \d\d:\d\d:\d\d\.\d{6}) (\d+) ([^:]+):(\d+)\](.*)$")


def this_line() -> int:
    frame = inspect.currentframe()
    assert frame is not None and frame.f_back is not None
    return frame.f_back.f_lineno


@pytest.mark.parametrize(
    ("log", "letter"),
    [
        (pb_utils.Logger.log_info, "I"),
        (pb_utils.Logger.log_warn, "W"),
        (pb_utils.Logger.log_error, "E"),
        (lambda text: pb_utils.Logger.log(text, pb_utils.Logger.ERROR), "E"),
        (lambda text: pb_utils.Logger.log(text), "I"),
    ],
)
def test_a_line_names_level_caller_and_place(
    capsys: pytest.CaptureFixture[str], log: object, letter: str
) -> None:
    log("hello, log")  # type: ignore[operator]
    written = capsys.readouterr().err
    match = LINE.match(written.rstrip("\n"))
    assert match is not None, written
    assert match.group(1) == letter
    assert match.group(4) == "test_pb_logger.py"
    assert match.group(6) == " hello, log"


def test_the_line_is_the_models_own_line(capsys: pytest.CaptureFixture[str]) -> None:
    line = this_line() + 1
    pb_utils.Logger.log_warn("where")
    match = LINE.match(capsys.readouterr().err.rstrip("\n"))
    assert match is not None
    assert int(match.group(5)) == line


@pytest.mark.usefixtures("worker_runtime")
def test_lines_carry_the_model_name_inside_a_worker(capsys: pytest.CaptureFixture[str]) -> None:
    ours, theirs = socket.socketpair()
    worker = link.WorkerLink(BlockingChannel(ours, codec.to_worker))
    worker.model_name = "add_sub"
    link.install(worker)
    try:
        pb_utils.Logger.log_info("loaded")
    finally:
        link.uninstall(worker)
        ours.close()
        theirs.close()
    assert capsys.readouterr().err.endswith("] [model 'add_sub'] loaded\n")


def test_verbose_only_when_asked(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DLSERVE_LOG_VERBOSE", raising=False)
    pb_utils.Logger.log_verbose("quiet")
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("DLSERVE_LOG_VERBOSE", "1")
    pb_utils.Logger.log("loud", pb_utils.Logger.VERBOSE)
    assert capsys.readouterr().err.endswith("] loud\n")
    assert pb_utils.Logger.LogLevel.VERBOSE == pb_utils.LogLevel.VERBOSE


def test_levels_the_log_settings_turn_off(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker's environment says which levels print (the server's log settings)."""
    env = log_settings_env(verbose=0, info=False, warning=True, error=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    pb_utils.Logger.log_info("hidden")
    pb_utils.Logger.log_error("hidden too")
    assert capsys.readouterr().err == ""
    pb_utils.Logger.log_warn("shown")
    assert capsys.readouterr().err.endswith("] shown\n")


def test_the_iso8601_format(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in log_settings_env(0, True, True, True, iso8601=True).items():
        monkeypatch.setenv(key, value)
    pb_utils.Logger.log_warn("stamped")
    line = capsys.readouterr().err
    assert re.fullmatch(
        rf"\d{{4}}-\d\d-\d\dT\d\d:\d\d:\d\dZ W {os.getpid()} test_pb_logger\.py:\d+\] stamped\n",
        line,
    ), line
