"""Fixtures of the transport tests."""

from __future__ import annotations

import types

import pytest

from dlserve.server.transport.h2 import limits


@pytest.fixture
def still_budgets(monkeypatch: pytest.MonkeyPatch) -> None:
    """The h2 flood budgets' clock stands still: a test that counts frames against a budget
    gets the same count however slowly the machine runs it (no token comes back meanwhile)."""
    monkeypatch.setattr(limits, "time", types.SimpleNamespace(monotonic=lambda: 0.0))
