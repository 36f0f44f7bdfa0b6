"""Imports a model's file as Triton's Python-backend stub does.

The stub appends the version folder and the model folder to ``sys.path`` and imports
``<version>.model``: the version folder is a package, so ``model.py`` may import the files
beside it relatively (``from . import helper``) or absolutely (``import helper``), and
``__name__`` is ``"1.model"``. The package is made here from the folder itself, not found
on ``sys.path``, so that another folder of the same name (in the working directory, or
another model's in an in-process worker) cannot stand in for it.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import itertools
import os
import sys
import threading
from types import ModuleType

# In-process workers load their models at the same time: a name is picked and taken in one step.
_naming = threading.Lock()


def import_model_file(path: str) -> ModuleType:
    """Import the model file at ``path`` (``<model>/<version>/model.py``) as
    ``<version>.model``; raises whatever the import raises."""
    version_dir = os.path.dirname(os.path.abspath(path))
    for folder in (version_dir, os.path.dirname(version_dir)):
        if folder not in sys.path:  # after what is there: the model's files shadow nothing
            sys.path.append(folder)
    package = _version_package(version_dir)
    stem = os.path.splitext(os.path.basename(path))[0]
    return importlib.import_module(f"{package.__name__}.{stem}")


def _version_package(version_dir: str) -> ModuleType:
    """The version folder as a package (its ``__init__.py`` run, when it has one), under the
    folder's name; under a fresh name when that name is taken (in-process workers share a
    process: two models' version 1, or one model loaded again)."""
    init = os.path.join(version_dir, "__init__.py")
    with _naming:
        name = _free_name(os.path.basename(version_dir))
        if os.path.isfile(init):
            spec = importlib.util.spec_from_file_location(
                name, init, submodule_search_locations=[version_dir]
            )
        else:  # a namespace package, as Python makes of a folder without __init__.py
            spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
            spec.submodule_search_locations = [version_dir]
        assert spec is not None
        package = importlib.util.module_from_spec(spec)
        sys.modules[name] = package
    if spec.loader is not None:
        try:
            spec.loader.exec_module(package)
        except BaseException:
            del sys.modules[name]
            raise
    return package


def _free_name(name: str) -> str:
    if name not in sys.modules:
        return name
    for number in itertools.count(2):
        candidate = f"{name}_{number}"
        if candidate not in sys.modules:
            return candidate
    raise AssertionError("unreachable")
