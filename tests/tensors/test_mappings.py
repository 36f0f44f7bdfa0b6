"""tensors/mappings.py: large buffers whose pages a thread gives back once nothing views
them; tensors/copies.py's large copies are such buffers."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from dlserve.tensors import copies, mappings

MIB = 2**20


@pytest.fixture
def unmapped_by(monkeypatch: pytest.MonkeyPatch) -> dict[int, int]:
    """The thread that unmapped each address, once ``munmap`` said it did (observed: the
    real call is made)."""
    threads: dict[int, int] = {}
    real = mappings._munmap

    def watched(address: int, size: int) -> int:
        done = int(real(address, size))
        if done == 0:
            threads[address] = threading.get_ident()
        return done

    monkeypatch.setattr(mappings, "_munmap", watched)
    return threads


def test_a_buffer_is_unmapped_by_a_thread_once_no_view_is_left(
    unmapped_by: dict[int, int],
) -> None:
    view = mappings.mapped(40 * MIB)
    assert (view.nbytes, view.readonly, view.format) == (40 * MIB, False, "B")
    array = np.frombuffer(view, np.uint8)
    array[:] = 7  # written: its pages are the process's now
    address = array.ctypes.data
    part = view[5:10]
    del view, array
    mappings.unmapped()
    assert address not in unmapped_by and bytes(part) == b"\x07" * 5  # a view is left
    del part
    mappings.unmapped()
    assert unmapped_by[address] != threading.get_ident()


def test_no_room_is_a_memory_error() -> None:
    with pytest.raises(MemoryError, match="mmap of"):
        mappings.mapped(2**62)


@pytest.mark.parametrize("readonly", [False, True])
def test_a_large_copy_has_pages_a_thread_gives_back(
    unmapped_by: dict[int, int], readonly: bool
) -> None:
    source = np.arange(mappings.UNMAP_ON_THREAD + 3, dtype=np.uint64).astype(np.uint8)
    copy = copies.unlocked_copy(source.data, readonly=readonly)
    assert copy.readonly is readonly and copy.nbytes == source.nbytes
    assert np.array_equal(np.frombuffer(copy, np.uint8), source)
    address = np.frombuffer(copy, np.uint8).ctypes.data
    mappings.unmapped()
    assert address not in unmapped_by
    del copy
    mappings.unmapped()
    assert unmapped_by[address] != threading.get_ident()


def test_a_smaller_copy_is_numpys_own(unmapped_by: dict[int, int]) -> None:
    source = np.ones(copies.COPY_ON_LOOP_LIMIT + 1, np.uint8)
    copy = copies.unlocked_copy(source.data, readonly=True)
    assert copy.readonly
    assert np.array_equal(np.frombuffer(copy, np.uint8), source)
    del copy
    mappings.unmapped()
    assert not unmapped_by
