"""Where a direct BLS call's time goes, step by step, in the running processes.

Copies ``src/``, ``benchmarks/`` and ``tools/`` into a temporary folder, inserts clock stamps
(``time.perf_counter_ns``, CLOCK_MONOTONIC: comparable across processes) at the steps of a
direct call in the copy (the caller's ``exec()``, the callee's serve loop, the runner, the
channel's ``recv``), runs ``bls_hops.py`` there with the options given, and prints, per
process, the median time between consecutive stamps (the first fifth of each sequence,
the warm-up, left out). ``src/`` itself is not changed: the stamps cost nothing there.

    python tools/hop_stamps.py [bls_hops.py options, e.g. --device cpu
        --busy-poll-us 2000 --bls-only]

A step often takes several times longer here than in a loop (its code and data are cold
after the process waited for the next frame, and the frame was written by another core):
that is what this probe is for. An anchor the code no longer has fails loudly: update
STAMPS. A probe for developers, not a benchmark of record.
"""

from __future__ import annotations

import collections
import itertools
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (file under src/dlserve, a piece of code found once there, stamp label, "before" the line
# where that piece starts or "after" the line where it ends).
STAMPS = [
    (
        "worker/bls/direct_caller.py",
        "    if not request.model_name() or not _plain(request):",
        "call.start",
        "before",
    ),
    ("worker/bls/direct_caller.py", "conn = target.take(", "call.took", "after"),
    (
        "worker/bls/direct_caller.py",
        "fences = cuda_peers.fences(devices) if",
        "call.encoded",
        "before",
    ),
    ("worker/bls/direct_caller.py", "staged = [r.offset for r in refs", "call.fenced", "before"),
    ("worker/bls/direct_caller.py", "infer = m.Infer(rid=-self._link", "call.checked", "before"),
    (
        "worker/bls/direct_caller.py",
        "return DirectCall(self, target, conn, sent",
        "call.sent",
        "before",
    ),
    ("worker/bls/direct_caller.py", "msg, payload = conn.channel.recv()", "call.answer", "after"),
    ("worker/bls/direct_caller.py", "done, payload = answer", "call.followed", "before"),
    ("worker/bls/direct_caller.py", "            return answered\n", "call.response", "before"),
    ("worker/bls/direct_caller.py", "self.call.done(done, lent_count(done))", "call.done", "after"),
    ("worker/link/link.py", "source = self.served.ready(self._channel)", "serve.ready", "after"),
    ("worker/bls/direct_callee.py", "conn.given_back(msg.release)", "serve.infer", "before"),
    ("worker/bls/direct_callee.py", "for _ in range(2):\n        try:", "serve.reply", "before"),
    ("worker/bls/direct_callee.py", "try:\n            conn.channel.send(", "serve.sent", "after"),
    ("worker/main.py", "replies = self.runner.execute((msg,)", "worker.infer", "before"),
    ("worker/main.py", "self.worker.send(*replies[0])", "worker.sent", "after"),
    ("worker/runner.py", "        if release:\n            self.release(", "run.start", "before"),
    ("worker/runner.py", "inputs = [self.inputs.tensor(ref", "run.fences_waited", "before"),
    ("worker/runner.py", "requests.append(request)", "run.request_built", "before"),
    ("worker/runner.py", "responses = self._call(self.model.execute", "run.executed", "after"),
    ("worker/runner.py", "settled = gpu_bls.settle_borrowed(ran)", "run.settled", "after"),
    ("worker/runner.py", "fences = gpu_bls.reply_fences(item", "run.fences_made", "after"),
    ("worker/outputs.py", "if wanted and tensor.name() not in", "out.tensor", "before"),
    ("worker/outputs.py", "text = response.parameters()", "out.done", "before"),
    ("worker/runner.py", "timings = m.Timings(execute.start", "run.replied", "before"),
    (
        "ipc/channel.py",
        "header_len, payload_len = codec.PREFIX.unpack_from(self._buf",
        "recv.read",
        "before",
    ),
    (
        "ipc/channel.py",
        "message = self._decoder.decode(memoryview(buf)[head",
        "recv.decoded",
        "after",
    ),
    # finer steps: a fence's record, the lend's parts, the reply's and the response's last
    ("worker/bls/cuda_peers.py", "cuda_ipc.record_event(own[0], device)", "fence.record", "before"),
    (
        "worker/bls/cuda_peers.py",
        "cuda_ipc.record_event(own[0], device)",
        "fence.recorded",
        "after",
    ),
    (
        "worker/bls/gpu_lending.py",
        "if regions.locate_cuda(info.ptr, nbytes)",
        "lend.start",
        "before",
    ),
    ("worker/bls/gpu_lending.py", "found = ipc.find(info.ptr, settled)", "lend.region", "before"),
    ("worker/bls/gpu_lending.py", "handle, offset = ipc.export(info.ptr", "lend.found", "before"),
    ("worker/bls/gpu_lending.py", "handle, offset = ipc.export(info.ptr", "lend.exported", "after"),
    ("worker/bls/gpu_lending.py", "return m.TensorRef(tensor.name(), ", "lend.counted", "before"),
    (
        "worker/bls/direct_callee.py",
        "done, buffers = reply\n    done.outputs = [worker.served.lent_ref",
        "serve.lent",
        "after",
    ),
    ("worker/bls/direct_callee.py", "done, buffers = _answer(runner", "serve.answered", "after"),
    (
        "worker/bls/direct_callee.py",
        "done.fences = cuda_peers.unfinished(",
        "serve.asked",
        "after",
    ),
    ("worker/bls/tensors.py", "base = cuda_peers.ipc().open(ref.", "response.opened", "after"),
    ("worker/bls/tensors.py", "tensors = [_output_tensor(", "response.wrapped", "after"),
    (
        "worker/bls/direct_caller.py",
        "batch = target.check(call, refs, payload)",
        "call.form",
        "after",
    ),
    (
        "worker/bls/direct_caller.py",
        "fences = cuda_peers.unfinished(fences)",
        "call.asked",
        "after",
    ),
    ("worker/bls/direct_caller.py", "conn.release_frame()\n        sent", "call.framed", "after"),
]

STAMPS_MODULE = """
import atexit, os, time
_buf = []
_dir = os.environ["DLSERVE_HOP_STAMPS"]
_ns = time.perf_counter_ns
def s(label):
    _buf.append((label, _ns()))
    if len(_buf) > 100000:
        _dump()
def _dump():
    with open(f"{_dir}/{os.getpid()}.txt", "a") as f:
        f.write("".join(f"{label} {t}\\n" for label, t in _buf))
    _buf.clear()
atexit.register(_dump)
"""


def patch(src: Path) -> None:
    (src / "dlserve" / "_hop_stamps.py").write_text(STAMPS_MODULE)
    by_file: dict[str, list[tuple[str, str, str]]] = collections.defaultdict(list)
    for name, anchor, label, where in STAMPS:
        by_file[name].append((anchor, label, where))
    for name, stamps in by_file.items():
        path = src / "dlserve" / name
        text = path.read_text()
        for anchor, label, where in stamps:
            if text.count(anchor) != 1:
                raise SystemExit(f"{name}: no single {anchor!r} for {label!r}: update STAMPS")
            at = text.index(anchor)
            if where == "after":
                at = text.index("\n", at + len(anchor.rstrip("\n"))) + 1
            else:
                at = text.rindex("\n", 0, at + 1) + 1  # the start of the anchor's line
            line_start = at if where == "before" else text.rindex("\n", 0, at - 1) + 1
            line = text[line_start : text.index("\n", line_start)]
            indent = line[: len(line) - len(line.lstrip())]
            text = text[:at] + f"{indent}_hop_stamps.s({label!r})\n" + text[at:]
        head = "from __future__ import annotations\n"
        text = text.replace(head, head + "from dlserve import _hop_stamps\n", 1)
        path.write_text(text)


def report(folder: Path) -> None:
    for path in sorted(folder.glob("*.txt")):
        rows = [line.split() for line in path.read_text().splitlines()]
        stamps = [(label, int(t)) for label, t in rows]
        steps: dict[str, list[float]] = collections.defaultdict(list)
        for (a, ta), (b, tb) in itertools.pairwise(stamps):
            steps[f"{a} -> {b}"].append((tb - ta) / 1e3)
        labels = {label for label, _ in stamps}
        role = (
            "BLS caller"
            if "call.start" in labels
            else ("callee" if "serve.infer" in labels else "model served by the server")
        )
        often = [(step, times) for step, times in steps.items() if len(times) >= 200]
        if not often:
            continue  # the server's process: it only imports the stamped modules
        print(f"== process {path.stem} ({role}): median us between stamps")
        for step, times in sorted(often, key=lambda kv: -len(kv[1])):
            kept = times[len(times) // 5 :]
            print(f"  {step:<42} {statistics.median(kept):8.1f}  (n={len(kept)})")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        ignore = shutil.ignore_patterns("__pycache__")
        shutil.copytree(ROOT / "src", root / "src", ignore=ignore)
        shutil.copytree(ROOT / "benchmarks", root / "benchmarks", ignore=ignore)
        shutil.copytree(ROOT / "tools", root / "tools", ignore=ignore)
        patch(root / "src")
        out = root / "stamps"
        out.mkdir()
        env = {**os.environ, "DLSERVE_HOP_STAMPS": str(out)}
        probe = root / "tools" / "bls_hops.py"
        subprocess.run([sys.executable, str(probe), *sys.argv[1:]], env=env, check=True)
        report(out)


if __name__ == "__main__":
    main()
