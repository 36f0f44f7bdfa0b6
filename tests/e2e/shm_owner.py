"""A client process for the reclaim tests: registers system shared-memory regions with
unmodified tritonclient, says which on stdout (one JSON line), then waits to be killed.

usage: python shm_owner.py PROTOCOL URL COUNT [--forget]
"""

from __future__ import annotations

import json
import os
import sys
import uuid

import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient


def main() -> None:
    protocol, url, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    lib = grpcclient if protocol == "grpc" else httpclient
    client = lib.InferenceServerClient(url)
    names, keys = [], []
    for index in range(count):
        key = f"/reclaim_{os.getpid()}_{uuid.uuid4().hex[:8]}_{index}"
        fd = os.open(f"/dev/shm{key}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, 4096)
        os.close(fd)
        name = key.lstrip("/")
        client.register_system_shared_memory(name, key, 4096)
        names.append(name)
        keys.append(key)
    print(json.dumps({"pid": os.getpid(), "names": names, "keys": keys}), flush=True)
    sys.stdin.read()  # until the test kills us (or closes our stdin)


if __name__ == "__main__":
    main()
