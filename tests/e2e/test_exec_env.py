"""A model's own Python environment (the ``EXECUTION_ENV_PATH`` parameter), as Triton's
Python backend runs it: a folder or a conda-pack style archive, ``$$TRITON_MODEL_DIRECTORY``
in the path, the archive extracted again when it changes, a clear reason when the
environment cannot run the model.

The environments are real: a venv of the interpreter that runs the tests, holding a
package of its own (``envprobe``) and numpy (linked from the test environment, as the
worker needs it there), and not the test environment's other packages."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from conftest import TEST_MODELS, run_server

MODEL = "env_probe"


def build_env(root: Path, marker: str) -> Path:
    """A venv at ``root`` with ``envprobe.VALUE = marker`` and numpy (a link) in it."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    site = root / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    (site / "envprobe").mkdir()
    (site / "envprobe" / "__init__.py").write_text(f"VALUE = {marker!r}\n")
    numpy_dir = Path(np.__file__).parent
    for name in ("numpy", "numpy.libs"):
        if (numpy_dir.parent / name).exists():
            (site / name).symlink_to(numpy_dir.parent / name)
    return root


def archive(env: Path, target: Path) -> Path:
    with tarfile.open(target, "w:gz") as tar:
        for entry in sorted(env.iterdir()):
            tar.add(entry, arcname=entry.name)
    return target


def add_model(repository: Path, name: str, env_path: str | None) -> Path:
    folder = repository / name
    shutil.copytree(TEST_MODELS / MODEL, folder)
    config = folder / "config.pbtxt"
    text = config.read_text() + f'name: "{name}"\n'
    if env_path is not None:
        value = f'value {{ string_value: "{env_path}" }}'
        text += f'parameters {{ key: "EXECUTION_ENV_PATH" {value} }}\n'
    config.write_text(text)
    return folder


def probe(client: grpcclient.InferenceServerClient, name: str) -> dict[str, str]:
    tensor = grpcclient.InferInput("INPUT0", [1], "FP32")
    tensor.set_data_from_numpy(np.zeros(1, np.float32))
    result = client.infer(name, [tensor])
    return {key: result.as_numpy(key)[0].decode() for key in ("PREFIX", "MARKER", "SERVER_PACKAGE")}


def reasons(client: grpcclient.InferenceServerClient) -> dict[str, tuple[str, str]]:
    index = client.get_model_repository_index()
    return {model.name: (model.state, model.reason) for model in index.models}


@pytest.fixture(scope="module")
def env_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_env(tmp_path_factory.mktemp("envs") / "env", "folder")


@pytest.fixture
def repository(tmp_path: Path) -> Iterator[Path]:
    folder = tmp_path / "models"
    folder.mkdir()
    yield folder


def test_a_model_runs_in_the_folder_its_config_names(repository: Path, env_dir: Path) -> None:
    add_model(repository, "in_env", str(env_dir))
    add_model(repository, "in_server_env", None)  # the control: the server's Python
    with run_server(repository) as server, grpcclient.InferenceServerClient(server.grpc_url) as c:
        inside = probe(c, "in_env")
        assert Path(inside["PREFIX"]).resolve() == env_dir.resolve()
        assert inside["MARKER"] == "folder"  # the environment's own package
        assert inside["SERVER_PACKAGE"] == "no"  # and none of the server's
        outside = probe(c, "in_server_env")
        assert Path(outside["PREFIX"]).resolve() == Path(sys.prefix).resolve()
        assert outside["MARKER"] == ""
        assert outside["SERVER_PACKAGE"] == "yes"


def test_an_archive_in_the_model_folder_is_extracted_and_removed_at_exit(
    repository: Path, env_dir: Path
) -> None:
    folder = add_model(repository, "packed", "$$TRITON_MODEL_DIRECTORY/env.tar.gz")
    archive(env_dir, folder / "env.tar.gz")
    with run_server(repository) as server, grpcclient.InferenceServerClient(server.grpc_url) as c:
        inside = probe(c, "packed")
        prefix = Path(inside["PREFIX"])
        assert prefix.is_dir() and prefix.resolve() != env_dir.resolve()  # extracted
        assert inside["MARKER"] == "folder"
        assert inside["SERVER_PACKAGE"] == "no"
    assert not prefix.exists()  # the server removed what it extracted


def test_a_changed_archive_is_extracted_again_on_reload(repository: Path, tmp_path: Path) -> None:
    folder = add_model(repository, "packed", "$$TRITON_MODEL_DIRECTORY/env.tar.gz")
    target = folder / "env.tar.gz"
    archive(build_env(tmp_path / "v1", "one"), target)
    explicit = ("--model-control-mode", "explicit", "--load-model", "packed")
    with run_server(repository, *explicit) as s, grpcclient.InferenceServerClient(s.grpc_url) as c:
        assert probe(c, "packed")["MARKER"] == "one"
        c.load_model("packed")  # unchanged: the same extraction serves
        assert probe(c, "packed")["MARKER"] == "one"
        archive(build_env(tmp_path / "v2", "two"), target)
        stat = target.stat()
        os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
        c.load_model("packed")
        assert probe(c, "packed")["MARKER"] == "two"


def fake_python_env(root: Path, reply: str) -> Path:
    """A folder that looks like an environment whose python prints ``reply``."""
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "activate").write_text("")
    python = root / "bin" / "python3"
    python.write_text(f"#!/bin/sh\necho '{reply}'\n")
    python.chmod(0o755)
    return root


def test_an_environment_that_cannot_run_the_model_makes_it_unavailable_with_the_reason(
    repository: Path, tmp_path: Path, env_dir: Path
) -> None:
    missing = tmp_path / "nowhere.tar.gz"
    add_model(repository, "missing", str(missing))
    no_activate = tmp_path / "no_activate"
    (no_activate / "bin").mkdir(parents=True)
    add_model(repository, "no_activate", str(no_activate))
    old = fake_python_env(tmp_path / "old", '{"version": [3, 9], "numpy": true, "msgspec": true}')
    add_model(repository, "old_python", str(old))
    no_numpy = '{"version": [3, 11], "numpy": false, "msgspec": true}'
    bare = fake_python_env(tmp_path / "bare", no_numpy)
    add_model(repository, "no_numpy", str(bare))
    broken = tmp_path / "broken.tar.gz"
    broken.write_bytes(b"not an archive")
    add_model(repository, "broken_archive", str(broken))
    add_model(repository, "fine", str(env_dir))
    serving = run_server(repository, "--exit-on-error", "false")  # the failed ones are asked
    with serving as server, grpcclient.InferenceServerClient(server.grpc_url) as c:
        states = reasons(c)
        assert states["fine"][0] == "READY"
        assert probe(c, "fine")["MARKER"] == "folder"
        expected = {
            "missing": f"EXECUTION_ENV_PATH '{missing}' cannot be used: No such file or directory",
            "no_activate": "The Python environment should contain an 'activate' script.",
            "old_python": "holds Python 3.9; dlserve's workers need Python 3.11 or newer",
            "no_numpy": "has no numpy; install it in the environment",
            "broken_archive": f"EXECUTION_ENV_PATH '{broken}' could not be extracted",
        }
        for name, words in expected.items():
            state, reason = states[name]
            assert state == "UNAVAILABLE" and words in reason, (name, reason)


def test_a_python_without_msgspec_must_be_the_servers_version(
    repository: Path, tmp_path: Path
) -> None:
    other = (sys.version_info[0], sys.version_info[1] + 1)
    reply = f'{{"version": [{other[0]}, {other[1]}], "numpy": true, "msgspec": false}}'
    add_model(repository, "other_python", str(fake_python_env(tmp_path / "other", reply)))
    serving = run_server(repository, "--exit-on-error", "false")
    with serving as server, grpcclient.InferenceServerClient(server.grpc_url) as c:
        state, reason = reasons(c)["other_python"]
    assert state == "UNAVAILABLE"
    assert f"holds Python {other[0]}.{other[1]} and no msgspec; install msgspec" in reason
    assert sysconfig.get_python_version() in reason  # names the server's version
