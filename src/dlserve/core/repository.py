"""The model repository on disk: Triton's layout, versions and version policy.

``<repo>/<model>/config.pbtxt`` and ``<repo>/<model>/<version>/model.py``
(or the config's ``default_model_filename``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dlserve.core.config import ConfigError, config_from_json, read_config
from dlserve.errors import NotFoundError


@dataclass(frozen=True, slots=True)
class ModelSource:
    """What the repository says about one model, before anything is started."""

    name: str
    path: Path
    config: Any  # model_config_pb2.ModelConfig, as read (auto-complete and defaults come later)
    versions: dict[int, Path]  # every numeric version folder -> its model file


class Repository:
    def __init__(self, root: Path) -> None:
        self.root = root

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
            return bool(read_config(self.root / name).platform == "ensemble")
        except ConfigError:
            return False

    def source(self, name: str, config_json: str | None = None) -> ModelSource:
        """Read a model's config and version folders; raises NotFoundError / ConfigError."""
        path = self.root / name
        if not name or "/" in name or name.startswith(".") or not path.is_dir():
            raise NotFoundError(f"failed to load '{name}', failed to poll from model repository")
        if config_json is not None:
            config = config_from_json(config_json, f"the load request for '{name}'")
        else:
            config = read_config(path)
        filename = config.default_model_filename or "model.py"
        versions = {
            int(entry.name): entry / filename
            for entry in path.iterdir()
            if entry.is_dir() and entry.name.isdigit()
        }
        return ModelSource(name, path, config, versions)


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
