"""The log line of a failure that happens in the background (a decoupled model's ``async
def execute`` that raised after its execute call had returned): Triton's line format on
the worker's stderr, which is the server's log, with the instance, the message and the
traceback."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dlserve.ipc import messages as m
from dlserve.pb_utils.exceptions import TritonError
from dlserve.worker.decoupled import log_failure


@pytest.fixture
def load(tmp_path: Path) -> m.Load:
    """The instance's Load: its names are the log line's."""
    return m.Load("waiter", 1, str(tmp_path), str(tmp_path), str(tmp_path / "model.py"),
                  json.dumps({"name": "waiter"}), "waiter_0_0", "CPU", 0)  # fmt: skip


def raise_it() -> None:
    raise ValueError("wait_secs cannot be negative")


def test_a_raised_exception_is_logged_with_its_message_and_traceback(
    load: m.Load, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        raise_it()
    except ValueError as exc:
        log_failure(load, exc)
    line = capsys.readouterr().err
    head = re.compile(r"^E\d{4} \d\d:\d\d:\d\d\.\d{6} \d+ test_failure_log\.py:\d+\] "
                      r"\[model 'waiter'\] Failed to process the request\(s\) for model "
                      r"'waiter_0_0', message: Traceback")  # fmt: skip
    assert head.match(line), line
    assert "in raise_it" in line
    assert line.endswith("ValueError: wait_secs cannot be negative\n")


def test_dlserves_own_check_is_logged_with_its_message(
    load: m.Load, capsys: pytest.CaptureFixture[str]
) -> None:
    log_failure(load, TritonError("Python model 'waiter_0_0' is using the decoupled mode"))
    line = capsys.readouterr().err
    assert line.endswith(
        "Failed to process the request(s) for model 'waiter_0_0', message: Python model "
        "'waiter_0_0' is using the decoupled mode\n"
    )
