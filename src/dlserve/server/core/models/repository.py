"""The model repository on disk: Triton's layout, versions and version policy.

``<repo>/<model>/config.pbtxt`` and ``<repo>/<model>/<version>/model.py``
(or the config's ``default_model_filename``).

A load request may bring the model's files instead (Triton's ``file:<path>`` load
parameters, with ``config``): they are written into a folder of their own under a
temporary folder of this server's, which then stands for the model's folder until the
model is loaded again or unloaded (the repository's own folder, if any, is not touched).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Final

from dlserve.errors import InvalidArgumentError, NotFoundError
from dlserve.server.core.models.config import ConfigError, config_from_json, read_config

FILE_PREFIX: Final = "file:"  # a load parameter that carries one of the model's files


@dataclass(frozen=True, slots=True)
class ModelSource:
    """What the repository says about one model, before anything is started."""

    name: str
    path: Path
    config: Any  # model_config_pb2.ModelConfig, as read (auto-complete and defaults come later)
    versions: dict[int, Path]  # every numeric version folder -> its model file


class Repository:
    def __init__(self, root: Path, config_name: str = "") -> None:
        self.root = root
        self.config_name = config_name  # --model-config-name: configs/<name>.pbtxt first
        self._sent: Path | None = None  # the folder that holds models sent with load requests

    def model_names(self) -> list[str]:
        """Every directory of the repository (each is a model, loadable or not)."""
        try:
            entries = sorted(self.root.iterdir())
        except OSError:
            return []
        return [e.name for e in entries if e.is_dir() and not e.name.startswith(".")]

    def is_ensemble(self, name: str) -> bool:
        """Whether the model's config.pbtxt says ``platform: "ensemble"`` (False if unreadable)."""
        try:
            return bool(read_config(self.root / name, self.config_name).platform == "ensemble")
        except ConfigError:
            return False

    def source(
        self, name: str, config_json: str | None = None, files: Mapping[str, bytes] | None = None
    ) -> ModelSource:
        """Read a model's config and version folders; raises NotFoundError / ConfigError.
        ``files`` (``file:<path>`` -> bytes): the model's files, sent with the request."""
        if files:
            return self._sent_source(name, config_json, files)
        path = self.root / name
        if not _valid_name(name) or not path.is_dir():
            raise NotFoundError(f"failed to load '{name}', failed to poll from model repository")
        if config_json is not None:
            config = config_from_json(config_json, f"the load request for '{name}'")
        else:
            config = read_config(path, self.config_name)
        return ModelSource(name, path, config, _versions(path, config))

    def _sent_source(
        self, name: str, config_json: str | None, files: Mapping[str, bytes]
    ) -> ModelSource:
        if not _valid_name(name):
            raise InvalidArgumentError(f"failed to load '{name}': not a valid model name")
        if config_json is None:
            raise InvalidArgumentError(
                f"failed to load '{name}': a load request that sends the model's files must "
                "also send its 'config'"
            )
        config = config_from_json(config_json, f"the load request for '{name}'")
        if self._sent is None:
            self._sent = Path(tempfile.mkdtemp(prefix="dlserve-sent-models-"))
        folder = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self._sent))
        try:
            for key, data in files.items():
                target = folder / _file_path(name, key)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        return ModelSource(name, folder, config, _versions(folder, config))

    def forget(self, path: Path) -> None:
        """A model's folder is no longer used: removed when it held files sent with a load
        request (the repository's own folders stay)."""
        if self._sent is not None and path.parent == self._sent:
            shutil.rmtree(path, ignore_errors=True)

    def close(self) -> None:
        """The server stops: the files sent with load requests go."""
        if self._sent is not None:
            shutil.rmtree(self._sent, ignore_errors=True)
            self._sent = None


def _valid_name(name: str) -> bool:
    return bool(name) and "/" not in name and not name.startswith(".")


def _file_path(name: str, key: str) -> PurePosixPath:
    """Where a ``file:<path>`` load parameter goes in the model's folder; refused when it
    would land outside it."""
    relative = PurePosixPath(key.removeprefix(FILE_PREFIX))
    if (not key.startswith(FILE_PREFIX) or relative.is_absolute() or not relative.parts
            or any(part in ("..", ".") for part in relative.parts)):  # fmt: skip
        raise InvalidArgumentError(
            f"failed to load '{name}': invalid model file '{key}' (expected 'file:' and a "
            "relative path inside the model's folder, such as 'file:1/model.py')"
        )
    return relative


def _versions(path: Path, config: Any) -> dict[int, Path]:
    filename = config.default_model_filename or "model.py"
    return {
        int(entry.name): entry / filename
        for entry in path.iterdir()
        if entry.is_dir() and entry.name.isdigit()
    }


def select_versions(source: ModelSource, config: Any) -> list[int]:
    """The versions the version policy serves, newest first."""
    available = sorted(source.versions, reverse=True)
    policy = config.version_policy
    which = policy.WhichOneof("policy_choice")
    if which == "all":
        chosen = available
    elif which == "specific":
        chosen = [v for v in available if v in set(policy.specific.versions)]
    else:
        count = policy.latest.num_versions if which == "latest" else 1
        chosen = available[: max(count, 1)]
    if not chosen:
        raise ConfigError(
            f"at least one version must be available under the version policy of model "
            f"'{source.name}'"
        )
    if config.platform == "ensemble":
        return chosen  # version folders with nothing in them: the server runs the steps
    for version in chosen:
        model_file = source.versions[version]
        if not model_file.is_file():
            raise ConfigError(f"model '{source.name}' version {version}: {model_file} not found")
    return chosen
