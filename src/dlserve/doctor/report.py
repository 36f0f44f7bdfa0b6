"""A doctor's findings: one row per check (what was checked, the result, what was found, the
fix), printed as a table or as JSON; the exit status says whether something the server needs
is broken."""

from __future__ import annotations

import json
import shutil
import textwrap
from dataclasses import asdict, dataclass
from typing import Final, Literal

Result = Literal["ok", "warn", "fail", "skip"]
WIDTHS: Final = (24, 6, 44)


@dataclass(frozen=True, slots=True)
class Row:
    check: str
    result: Result
    found: str
    fix: str = ""


def exit_status(rows: list[Row]) -> int:
    """1 when something the server needs is broken (a ``fail``), else 0."""
    return 1 if any(row.result == "fail" for row in rows) else 0


def as_json(rows: list[Row]) -> str:
    return json.dumps({"ok": exit_status(rows) == 0, "checks": [asdict(r) for r in rows]}, indent=2)


def as_table(rows: list[Row]) -> str:
    width = max(shutil.get_terminal_size((120, 24)).columns, 100)
    fix_width = width - sum(WIDTHS) - 8
    header = ("check", "result", "found", "fix")
    lines = [
        _line(header, fix_width),
        _line(("-" * 24, "-" * 6, "-" * 44, "-" * fix_width), fix_width),
    ]
    for row in rows:
        lines.append(_line((row.check, row.result.upper(), row.found, row.fix), fix_width))
    return "\n".join(lines)


def _line(cells: tuple[str, str, str, str], fix_width: int) -> str:
    """One row, each cell wrapped to its column."""
    widths = (*WIDTHS, fix_width)
    wrapped = [textwrap.wrap(cell, w) or [""] for cell, w in zip(cells, widths, strict=True)]
    height = max(len(w) for w in wrapped)
    out = []
    for i in range(height):
        parts = [
            (w[i] if i < len(w) else "").ljust(width)
            for w, width in zip(wrapped, widths, strict=True)
        ]
        out.append("  ".join(parts).rstrip())
    return "\n".join(out)
