"""Architecture rules: dlserve's imports point one way, and nothing imports pickle.

frontends -> core -> workers -> ipc, tensors -> types, errors. The model-side
packages (backend, workers) never import a web stack; the core imports neither
grpc nor an HTTP framework.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "dlserve"

# package -> dlserve packages it may import (besides itself)
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "types": set(),
    "tensors": {"types", "errors"},
    "ipc": {"tensors", "types", "errors"},
    "backend": {"ipc", "tensors", "types", "errors"},
    "workers": {"backend", "ipc", "tensors", "types", "errors"},
    "core": {"workers", "ipc", "tensors", "types", "errors"},
    "frontends": {"core", "tensors", "types", "errors"},
    "client": {"tensors", "types", "errors"},
}
WEB = {"grpc", "starlette", "uvicorn", "httptools", "fastapi", "aiohttp"}
FORBIDDEN_EVERYWHERE = {"pickle", "cPickle", "cloudpickle", "dill", "shelve", "marshal"}
NO_WEB = {"core", "workers", "backend", "tensors", "ipc", "types", "errors"}


def imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "dlserve":  # from dlserve import errors
                names.extend(f"dlserve.{alias.name}" for alias in node.names)
            else:
                names.append(node.module)
    return names


def package_of(path: Path) -> str:
    rel = path.relative_to(SRC).parts
    return rel[0].removesuffix(".py") if rel else ""


def violations(path: Path) -> list[str]:
    found: list[str] = []
    package = package_of(path)
    for name in imports(path):
        top = name.split(".")[0]
        if top in FORBIDDEN_EVERYWHERE:
            found.append(f"{path}: imports {name} (no pickle across any boundary)")
        if package in NO_WEB and top in WEB:
            found.append(f"{path}: imports {name} (no web stack in '{package}')")
        parts = name.split(".")
        if package in ALLOWED and parts[0] == "dlserve" and len(parts) > 1:
            target = parts[1]
            if target not in (package, "__version__") and target not in ALLOWED[package]:
                found.append(f"{path}: '{package}' must not import dlserve.{target}")
    return found


def main() -> int:
    problems = [v for path in sorted(SRC.rglob("*.py")) for v in violations(path)]
    for problem in problems:
        print(problem)
    print(f"layers: {'FAILED' if problems else 'ok'} ({len(problems)} problems)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
