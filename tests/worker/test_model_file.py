"""Importing models' files as Triton's stub does, where several workers share a process
(in-process workers): each gets its own model, however their loads interleave."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from dlserve.worker.model_file import import_model_file

MODELS = 8
ROUNDS = 4


@pytest.fixture
def switching_often() -> Iterator[None]:
    """Threads take turns every microsecond, and what sys.path and sys.modules gain goes:
    a load that is not one step is cut in two."""
    before, path, modules = sys.getswitchinterval(), list(sys.path), set(sys.modules)
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(before)
        sys.path[:] = path
        for name in set(sys.modules) - modules:
            del sys.modules[name]


def load_at_once(files: list[Path]) -> list[ModuleType]:
    """Import every file, each in a thread of its own, all let go at the same moment."""
    start = threading.Barrier(len(files))
    loaded: dict[int, ModuleType] = {}

    def load(index: int) -> None:
        start.wait()
        loaded[index] = import_model_file(str(files[index]))

    threads = [threading.Thread(target=load, args=(i,)) for i in range(len(files))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [loaded[index] for index in range(len(files))]


def test_models_whose_version_folders_share_a_name_load_at_once(
    tmp_path: Path, switching_often: None
) -> None:
    for round_ in range(ROUNDS):
        files = []
        for index in range(MODELS):
            model = tmp_path / str(round_) / f"model_{index}" / "1" / "model.py"
            model.parent.mkdir(parents=True)
            model.write_text(f"WHO = {index}\n")
            files.append(model)
        modules = load_at_once(files)
        assert [module.WHO for module in modules] == list(range(MODELS))
        assert len({module.__name__ for module in modules}) == MODELS
