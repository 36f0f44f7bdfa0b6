"""deploy/systemd/dlserve.service: systemd accepts it, its stop timeout covers the server's
--exit-timeout-secs, and the server starts with its ExecStart's arguments and answers on the
Unix socket it names (the paths moved to this machine's)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient

from conftest import EXAMPLES, repository_of, run_server

UNIT = Path(__file__).resolve().parents[2] / "deploy" / "systemd" / "dlserve.service"


def settings() -> dict[str, str]:
    """The unit's ``Key=value`` lines (continuations joined; the last of a key wins)."""
    text = UNIT.read_text().replace("\\\n", " ")
    pairs = [line.split("=", 1) for line in text.splitlines() if "=" in line and line[0] != "#"]
    return {key.strip(): value.strip() for key, value in pairs}


def exec_arguments() -> list[str]:
    command = settings()["ExecStart"].split()
    assert command[:2] == ["/opt/dlserve/bin/dlserve", "serve"]
    return command[2:]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze missing")
def test_systemd_accepts_the_unit(tmp_path: Path) -> None:
    dlserve = shutil.which("dlserve") or "/bin/true"  # verify checks that the program exists
    unit = tmp_path / "dlserve.service"
    unit.write_text(UNIT.read_text().replace("/opt/dlserve/bin/dlserve", dlserve))
    done = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                          text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr


def test_the_stop_timeout_covers_the_servers_exit_timeout() -> None:
    args = exec_arguments()
    exit_timeout = int(args[args.index("--exit-timeout-secs") + 1])
    assert int(settings()["TimeoutStopSec"]) >= exit_timeout + 5
    assert settings()["KillSignal"] == "SIGTERM"


def test_the_server_starts_with_the_units_arguments(tmp_path: Path) -> None:
    args = exec_arguments()
    args[args.index("--model-repository") + 1] = str(
        repository_of(tmp_path / "models", EXAMPLES / "add_sub")
    )
    socket = tmp_path / "dlserve.sock"
    args[args.index("--grpc-uds") + 1] = str(socket)
    args[args.index("--host") + 1] = "127.0.0.1"  # the unit's 0.0.0.0, kept to this machine
    repository = Path(args[args.index("--model-repository") + 1])
    with run_server(repository, *args):
        client = grpcclient.InferenceServerClient(f"unix://{socket}")
        assert client.is_server_ready() and client.is_model_ready("add_sub")
