"""Architecture rules: which process a package runs in decides what it may import.

- The server process (``server/``): the command line and wiring may use all of it;
  frontends -> core -> the core's handles on its workers (``core/instances``) -> ipc,
  tensors. The transports (``server/transport``) are protocol machinery and import nothing
  of dlserve's domain. Nothing in the server imports the worker runtime or pb_utils.
- A worker process: the runtime (``worker/``) -> pb_utils, ipc, tensors; pb_utils,
  Triton's model-facing API, imports no worker internals (the runtime installs itself).
- Both sides: ipc -> tensors -> types, errors. Users' processes: client -> tensors. A
  host's checks (``dlserve doctor``, beside clients): doctor -> tensors.

No package of a worker or of the core imports a web stack, and nothing imports pickle.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "dlserve"

BOTH = {"ipc", "tensors", "types", "errors"}
# package (a path under src/dlserve, most specific first) -> the dlserve packages it may
# import besides itself; an entry ending in "/" allows that package and all below it.
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "types": set(),
    "tensors": {"types", "errors"},
    "ipc": {"tensors", "types", "errors"},
    "pb_utils": {"ipc", "tensors", "types", "errors"},
    "worker": {"pb_utils/", *BOTH},
    "client": {"tensors", "types", "errors"},
    "doctor": {"tensors", "types", "errors"},
    "server/transport": set(),
    "server/core/instances": set(BOTH),
    "server/core": {"server/core/", *BOTH},
    "server/frontends": {"server/frontends/", "server/core/", "server/transport/", *BOTH},
    "server": {"server/", *BOTH},
    "__init__": set(),
    "__main__": {"server/"},
}
# single edges that cross a rule, each with its reason
EXCEPTIONS: dict[str, set[str]] = {
    # --debug and the in-process tests run a worker's serve loop in a thread of the server
    "server/core/instances/thread": {"worker/main"},
    # `dlserve doctor` shares the `dlserve` command: the command line hands it its arguments
    "server/cli": {"doctor/main"},
}
WEB = {"grpc", "starlette", "uvicorn", "httptools", "fastapi", "aiohttp"}
FORBIDDEN_EVERYWHERE = {"pickle", "cPickle", "cloudpickle", "dill", "shelve", "marshal"}
NO_WEB = ("server/core", "worker", "pb_utils", "tensors", "ipc", "types", "errors")


def imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "dlserve" or node.module.startswith("dlserve."):
                names.extend(f"{node.module}.{alias.name}" for alias in node.names)
            else:
                names.append(node.module)
    return names


def package_of(path: Path) -> str:
    """The most specific ALLOWED key that contains ``path``."""
    rel = "/".join(path.relative_to(SRC).with_suffix("").parts)
    keys = sorted(ALLOWED, key=len, reverse=True)
    return next(k for k in keys if rel == k or rel.startswith(k + "/"))


def target_of(name: str) -> str | None:
    """The src/dlserve path a dotted dlserve name points at (module or package)."""
    parts = name.split(".")
    if parts[0] != "dlserve" or len(parts) < 2:
        return None
    for end in range(len(parts), 1, -1):
        path = SRC.joinpath(*parts[1:end])
        if path.with_suffix(".py").exists() or (path / "__init__.py").exists():
            return "/".join(parts[1:end])
    return None


def allowed(package: str, target: str) -> bool:
    if target == package or target.startswith(package + "/") or target == "__init__":
        return True
    for rule in ALLOWED[package]:
        if rule.endswith("/") and (target == rule[:-1] or target.startswith(rule)):
            return True
        if target == rule or target.startswith(rule + "/"):
            return True
    return False


def violations(path: Path) -> list[str]:
    found: list[str] = []
    package = package_of(path)
    module = "/".join(path.relative_to(SRC).with_suffix("").parts)
    excepted = EXCEPTIONS.get(module, set())
    for name in imports(path):
        top = name.split(".")[0]
        if top in FORBIDDEN_EVERYWHERE:
            found.append(f"{path}: imports {name} (no pickle across any boundary)")
        if package.startswith(NO_WEB) and top in WEB:
            found.append(f"{path}: imports {name} (no web stack in '{package}')")
        target = target_of(name)
        if target is not None and not allowed(package, target) and target not in excepted:
            found.append(f"{path}: '{package}' must not import dlserve.{target.replace('/', '.')}")
    return found


def main() -> int:
    problems = [v for path in sorted(SRC.rglob("*.py")) for v in violations(path)]
    for problem in problems:
        print(problem)
    print(f"layers: {'FAILED' if problems else 'ok'} ({len(problems)} problems)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
