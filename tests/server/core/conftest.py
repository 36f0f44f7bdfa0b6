"""The in-process core tier: ``async def`` tests run on an event loop of their own, and the
``core`` fixture gives each a model repository in its temporary folder (``harness.py``).

A package (``__init__.py``), so that this conftest does not take the name ``conftest`` from
the suite's root one, which other test folders import from.
"""

from __future__ import annotations

import asyncio
import inspect
from pathlib import Path

import pytest

from .harness import DEADLINE_S, Core

TEST_DEADLINE_S = 2 * DEADLINE_S  # a whole test, its service's startup and shutdown included


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """Run a coroutine test to its end on a new event loop (no asyncio plugin needed)."""
    test = pyfuncitem.obj
    if not inspect.iscoroutinefunction(test):
        return None
    arguments = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    asyncio.run(asyncio.wait_for(test(**arguments), TEST_DEADLINE_S))
    return True


@pytest.fixture
def core(tmp_path: Path) -> Core:
    return Core(tmp_path)
