"""A worker's mappings of client regions (``worker/client_regions.py``), on real /dev/shm objects.

- views are of the client's memory (writes show in the client's object) at any offset;
- a region is mapped once and its object opened once, by region id;
- an object shrunk below a view's end is refused with a clear error (instead of SIGBUS);
- an object grown past the mapping is mapped again;
- unmapping with a view still alive leaves that view usable.
And the messages that carry regions survive the codec.
"""

from __future__ import annotations

import mmap
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from dlserve.ipc import codec
from dlserve.ipc import messages as m
from dlserve.pb_utils.exceptions import TritonError
from dlserve.worker.client_regions import ClientRegions


@pytest.fixture
def client_object() -> Iterator[tuple[str, mmap.mmap]]:
    """A 2-page object and the client's own mapping of it."""
    name = f"test_worker_regions_{uuid.uuid4().hex}"
    path = Path("/dev/shm") / name
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, 2 * mmap.PAGESIZE)
    mine = mmap.mmap(fd, 2 * mmap.PAGESIZE)
    os.close(fd)
    try:
        yield "/" + name, mine
    finally:
        mine.close()
        path.unlink(missing_ok=True)


def ref(key: str, offset: int, nbytes: int, region: int = 1) -> m.TensorRef:
    return m.TensorRef("T", "FP32", [], m.Where.CLIENT_REGION, offset, nbytes, region, key)


def held(key: str) -> tuple[int, int]:
    """(mappings, open descriptors) of this process on the object ``key``."""
    path = f"/dev/shm/{key.lstrip('/')}"
    maps = Path("/proc/self/maps").read_text().count(path)
    fds = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds += os.readlink(f"/proc/self/fd/{fd}") == path
        except OSError:
            pass  # the descriptor listdir itself used
    return maps, fds


def test_views_are_the_clients_memory(client_object: tuple[str, mmap.mmap]) -> None:
    key, mine = client_object
    regions = ClientRegions()
    mine[4099:4103] = b"abcd"
    view = regions.view(ref(key, 4099, 4), "input 'T'")  # not page-aligned
    assert bytes(view) == b"abcd"
    view[:] = b"wxyz"
    assert mine[4099:4103] == b"wxyz"
    del view
    regions.close()


def test_a_region_is_mapped_once(client_object: tuple[str, mmap.mmap]) -> None:
    key, _ = client_object
    regions = ClientRegions()
    before_maps, before_fds = held(key)  # the client's own mapping
    for offset in range(0, 4096, 512):
        regions.view(ref(key, offset, 8), "x").release()
    maps, fds = held(key)
    assert (len(regions), maps) == (1, before_maps + 1) and fds > before_fds
    regions.view(ref(key, 0, 8, region=2), "x").release()  # another region, same key
    assert len(regions) == 2
    regions.unmap([1, 2, 3])
    assert (len(regions), held(key)) == (0, (before_maps, before_fds))


def test_a_truncated_object_is_refused(client_object: tuple[str, mmap.mmap]) -> None:
    key, _ = client_object
    regions = ClientRegions()
    regions.view(ref(key, 0, 8), "x").release()
    os.truncate(f"/dev/shm/{key[1:]}", mmap.PAGESIZE)
    with pytest.raises(TritonError) as info:
        regions.view(ref(key, mmap.PAGESIZE, 8), "input 'IN'")
    assert info.value.error_code().value == "invalid_arg"
    assert info.value.message() == (
        f"the shared memory object '{key}' holding input 'IN' is {mmap.PAGESIZE} bytes now, too "
        f"small for bytes {mmap.PAGESIZE} to {mmap.PAGESIZE + 8}: it was truncated after it was "
        "registered"
    )
    assert bytes(regions.view(ref(key, 8, 8), "x")) == bytes(8)  # below the new end: fine
    regions.close()


def test_a_grown_object_is_mapped_again(client_object: tuple[str, mmap.mmap]) -> None:
    key, _ = client_object
    regions = ClientRegions()
    early = regions.view(ref(key, 0, 4), "x")
    os.truncate(f"/dev/shm/{key[1:]}", 4 * mmap.PAGESIZE)
    late = regions.view(ref(key, 3 * mmap.PAGESIZE, 4), "x")
    late[:] = b"late"
    early[:] = b"earl"  # the old mapping lives on while a view of it does
    with open(f"/dev/shm/{key[1:]}", "rb") as f:
        content = f.read()
    assert content[:4] == b"earl" and content[3 * mmap.PAGESIZE :][:4] == b"late"
    del early, late
    regions.close()


def test_unmapping_while_a_view_is_alive(client_object: tuple[str, mmap.mmap]) -> None:
    key, mine = client_object
    regions = ClientRegions()
    array = np.frombuffer(regions.view(ref(key, 0, 8), "x"), dtype=np.float32)
    regions.unmap([1])  # the model kept an input past execute: no crash, no dangling view
    mine[0:8] = np.array([1, 2], np.float32).tobytes()
    assert list(array) == [1.0, 2.0]


def test_zero_bytes_and_unknown_keys(client_object: tuple[str, mmap.mmap]) -> None:
    key, _ = client_object
    regions = ClientRegions()
    assert regions.view(ref(key, 2 * mmap.PAGESIZE, 0), "x").nbytes == 0
    with pytest.raises(TritonError, match="unable to open the shared memory object '/gone'"):
        regions.view(ref("/gone", 0, 4, region=9), "x")
    regions.close()


def test_region_messages_survive_the_codec() -> None:
    output = ref("/k", 5, 64, region=7)
    infer = m.Infer(
        rid=1, request_id="id", inputs=[ref("/k", 3, 8)], outputs=["OUT"], output_regions=[output]
    )
    for message in (infer, m.UnmapRegions([7, 8])):
        header = codec.encode(message)[1]
        assert codec.to_worker.decode(header) == message
