"""A model's own Python environment: the ``EXECUTION_ENV_PATH`` model parameter.

Triton's Python backend runs a model's stub in the environment the parameter names: a
conda-pack archive (``.tar.gz``), extracted once per server into a temporary folder (again
when the archive changes), or a folder that holds the environment already.
``$$TRITON_MODEL_DIRECTORY`` in the value stands for the model's folder. The stub starts
as ``source <env>/bin/activate && exec env LD_LIBRARY_PATH=<env>/lib:... stub ...``.

dlserve starts the model's worker the same way, with the environment's own interpreter:
the model imports the environment's packages, never the server's. The worker itself needs
dlserve (pure Python), numpy and msgspec: numpy must be in the environment (as Triton's
stub requires), msgspec is taken from the environment when it has it, else from the
server (then the environment's Python must be the server's version: msgspec is compiled).
Only those two packages of the server's are put on the worker's path, after the
environment's own.

Each environment is probed once (its Python version, whether it has numpy and msgspec),
and a model whose environment cannot run a worker is UNAVAILABLE with the reason.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from dlserve.errors import InvalidArgumentError as ConfigError

PARAMETER: Final = "EXECUTION_ENV_PATH"
MODEL_DIRECTORY: Final = "$$TRITON_MODEL_DIRECTORY"
MIN_PYTHON: Final = (3, 11)  # dlserve's own
PROBE_TIMEOUT_S: Final = 60.0

# Run by bash: activate the environment, then start the worker with its interpreter.
# $1 the environment, $2 its python, $3 the bootstrap code, the rest the worker's options.
_LAUNCH: Final = (
    'source "$1/bin/activate" && '
    'exec env LD_LIBRARY_PATH="$1/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" '
    '"$2" -c "$3" "${@:4}"'
)
_BOOTSTRAP: Final = (
    "import sys, runpy; sys.path.append({path!r}); "
    "runpy.run_module('dlserve.worker.main', run_name='__main__', alter_sys=True)"
)
_PROBE: Final = (
    "import json, sys, importlib.util as u; print(json.dumps({'version': sys.version_info[:2],"
    " 'numpy': u.find_spec('numpy') is not None, 'msgspec': u.find_spec('msgspec') is not None,"
    " 'cuda': u.find_spec('cuda') is not None and u.find_spec('cuda.bindings') is not None}))"
)


@dataclass(frozen=True, slots=True)
class ExecEnv:
    """A prepared environment: how to start a worker in it."""

    root: Path
    python: Path
    path_dir: Path  # dlserve (and msgspec when the environment has none), for sys.path

    def environment(self) -> dict[str, str]:
        return isolated_environment()

    def command(self, worker_args: list[str]) -> list[str]:
        bootstrap = _BOOTSTRAP.format(path=str(self.path_dir))
        return ["bash", "-c", _LAUNCH, "dlserve-worker", str(self.root), str(self.python),
                bootstrap, *worker_args]  # fmt: skip


def isolated_environment() -> dict[str, str]:
    """The server's environment variables without PYTHONPATH and PYTHONHOME: they would put
    the server's packages before the environment's own (the worker adds what it needs)."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


def requested(parameters: object, model_dir: Path) -> str | None:
    """The environment a model's config asks for (``$$TRITON_MODEL_DIRECTORY`` resolved),
    or None. ``parameters``: the config's ``parameters`` map."""
    entry = parameters.get(PARAMETER) if hasattr(parameters, "get") else None
    value = "" if entry is None else str(entry.string_value)
    if not value:
        return None
    return value.replace(MODEL_DIRECTORY, str(model_dir), 1)


class Environments:
    """The server's prepared environments, extracted under one temporary folder that goes
    when the server stops."""

    def __init__(self) -> None:
        self._base: Path | None = None
        self._prepared: dict[tuple[str, int], ExecEnv] = {}  # (real path, mtime) -> env
        self._lock = asyncio.Lock()

    async def prepare(self, value: str, model: str) -> ExecEnv:
        """The environment ``value`` names, extracted and probed (once per version of it)."""
        async with self._lock:  # two models of one archive extract it once
            path = Path(value)
            try:
                real = path.resolve(strict=True)
                mtime = real.stat().st_mtime_ns
            except OSError as exc:
                raise ConfigError(
                    f"model '{model}': {PARAMETER} '{value}' cannot be used: {exc.strerror}"
                ) from None
            key = (str(real), mtime)
            if key not in self._prepared:
                self._prepared[key] = await asyncio.to_thread(self._prepare, real, value, model)
            return self._prepared[key]

    def _prepare(self, real: Path, value: str, model: str) -> ExecEnv:
        if real.is_dir():
            root = real
        else:
            root = self._extract(real, value, model)
        if not (root / "bin" / "activate").is_file():
            raise ConfigError(
                f"model '{model}': Path {root / 'bin' / 'activate'} does not exist. The Python "
                "environment should contain an 'activate' script."
            )
        python = next((p for p in (root / "bin" / "python3", root / "bin" / "python")
                       if p.exists()), None)  # fmt: skip
        if python is None:
            raise ConfigError(f"model '{model}': {PARAMETER} '{value}' has no bin/python3")
        return ExecEnv(root, python, self._path_dir(_probe(root, python, value, model)))

    def _extract(self, archive: Path, value: str, model: str) -> Path:
        if self._base is None:
            self._base = Path(tempfile.mkdtemp(prefix="dlserve_python_env_"))
        root = Path(tempfile.mkdtemp(dir=self._base))  # one per archive and version of it
        try:
            with tarfile.open(archive, "r:*") as tar:
                if hasattr(tarfile, "tar_filter"):  # Python 3.11.4 and newer
                    tar.extractall(root, filter="tar")  # links kept: conda-pack has them
                else:  # pragma: no cover
                    tar.extractall(root)
        except (tarfile.TarError, OSError) as exc:
            shutil.rmtree(root, ignore_errors=True)
            raise ConfigError(
                f"model '{model}': {PARAMETER} '{value}' could not be extracted: {exc}"
            ) from None
        return root

    def _path_dir(self, probe: dict[str, object]) -> Path:
        """A folder of links to the server's packages the environment lacks: dlserve, and
        msgspec and cuda-python (compiled: only for the server's Python version)."""
        if self._base is None:
            self._base = Path(tempfile.mkdtemp(prefix="dlserve_python_env_"))
        packages = ["dlserve"]
        if tuple(probe["version"]) == sys.version_info[:2]:  # type: ignore[arg-type]
            packages += [name for name in ("msgspec", "cuda") if not probe.get(name)]
        packages = [name for name in packages if _package_dir(name) is not None]
        folder = self._base / ("path_" + "_".join(packages))
        if not folder.exists():
            folder.mkdir()
            for name in packages:
                source = _package_dir(name)
                assert source is not None
                (folder / name).symlink_to(source, target_is_directory=True)
        return folder

    def close(self) -> None:
        if self._base is not None:
            shutil.rmtree(self._base, ignore_errors=True)
            self._base = None
        self._prepared.clear()


def _probe(root: Path, python: Path, value: str, model: str) -> dict[str, object]:
    """Ask the environment's interpreter (activated) what it has."""
    command = ["bash", "-c", _LAUNCH, "probe", str(root), str(python), _PROBE]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S,
                              stdin=subprocess.DEVNULL, env=isolated_environment())  # fmt: skip
    except (OSError, subprocess.SubprocessError) as exc:
        raise ConfigError(
            f"model '{model}': the Python of {PARAMETER} '{value}' does not run: {exc}"
        ) from None
    try:
        probe: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
        version: tuple[int, ...] = tuple(probe["version"])  # type: ignore[arg-type]
    except (ValueError, IndexError, KeyError, TypeError):
        raise ConfigError(
            f"model '{model}': the Python of {PARAMETER} '{value}' does not run: "
            f"{(done.stderr.strip() or done.stdout.strip())[-500:]}"
        ) from None
    have = ".".join(map(str, version))
    if version < MIN_PYTHON:
        raise ConfigError(
            f"model '{model}': {PARAMETER} '{value}' holds Python {have}; dlserve's workers "
            f"need Python {'.'.join(map(str, MIN_PYTHON))} or newer"
        )
    if not probe["numpy"]:
        raise ConfigError(
            f"model '{model}': {PARAMETER} '{value}' has no numpy; install it in the "
            "environment (Triton's Python backend needs it there too)"
        )
    ours = sys.version_info[:2]
    if not probe["msgspec"] and version != ours:
        raise ConfigError(
            f"model '{model}': {PARAMETER} '{value}' holds Python {have} and no msgspec; "
            f"install msgspec in the environment, or use Python {ours[0]}.{ours[1]} (the "
            "server's, whose msgspec the worker can then use)"
        )
    return probe


def _package_dir(name: str) -> Path | None:
    """The folder of one of the server's packages (None: not installed)."""
    try:
        spec = importlib.util.find_spec(name)
    except ImportError:
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


__all__ = ["PARAMETER", "Environments", "ExecEnv", "requested"]
