"""The response cache's pieces, bytes in and out: the key (what makes two requests the same),
the LRU store and its byte accounting, and ``--cache-config`` parsing."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable

import numpy as np
import pytest

from dlserve.server.core.cache.cache_config import (
    CacheConfigError,
    CacheSettings,
    parse_cache_config,
)
from dlserve.server.core.cache.response_cache import (
    CachedTensor,
    Outputs,
    ResponseCache,
    packed_size,
    request_key,
)
from dlserve.types import InferRequest, InputTensor, OutputTensor, RequestedOutput


def _request(
    data: np.ndarray, *, datatype: str = "FP32", outputs: tuple[str, ...] = (), **params: object
) -> InferRequest:
    tensor = InputTensor("INPUT0", datatype, data.shape, memoryview(data.tobytes()))
    return InferRequest(
        "cached", "", "id", [tensor], [RequestedOutput(n) for n in outputs], dict(params)
    )


A = np.arange(6, dtype=np.float32).reshape(2, 3)


def test_the_same_request_has_the_same_key_whatever_its_id() -> None:
    first, second = _request(A), _request(A.copy())
    second.id = "another"
    assert request_key(1, "1", first) == request_key(1, "1", second)


@pytest.mark.parametrize(
    "other",
    [
        _request(A + 1),  # bytes
        _request(A.reshape(3, 2)),  # shape, same bytes
        _request(A, datatype="INT32"),  # datatype, same bytes
        _request(A, outputs=("OUTPUT0",)),  # the outputs asked for
        _request(A, outputs=("OUTPUT1", "OUTPUT0")),
        _request(A, offset=1),  # a parameter the model sees
        _request(A, offset=True),  # its type too
    ],
    ids=["bytes", "shape", "datatype", "outputs", "output order", "parameter", "param type"],
)
def test_what_decides_the_response_is_in_the_key(other: InferRequest) -> None:
    assert request_key(1, "1", _request(A)) != request_key(1, "1", other)


def test_versions_and_loads_have_key_spaces_of_their_own() -> None:
    request = _request(A)
    keys = {request_key(1, "1", request), request_key(1, "2", request)}
    keys.add(request_key(2, "1", request))
    assert len(keys) == 3


def test_scheduling_parameters_are_not_in_the_key_sequence_ones_are() -> None:
    plain = request_key(1, "1", _request(A))
    assert request_key(1, "1", _request(A, priority=1, timeout=5)) == plain
    assert request_key(1, "1", _request(A, sequence_id=7)) != plain  # correlation_id()


def _outputs(nbytes: int) -> tuple[list[OutputTensor], dict[str, object]]:
    data = bytes(nbytes)
    return [OutputTensor("OUTPUT0", "UINT8", (nbytes,), memoryview(data))], {}


def _size(nbytes: int) -> int:
    return packed_size((CachedTensor("OUTPUT0", "UINT8", (nbytes,), bytes(nbytes)),), {})


def test_least_recently_used_entries_are_evicted_to_make_room() -> None:
    cache = ResponseCache(2 * _size(100) + _size(100) // 2)
    owner = cache.open()
    assert cache.put(b"a", owner, _outputs(100))
    assert cache.put(b"b", owner, _outputs(100))
    assert cache.get(b"a") is not None  # a is now the most recently used
    assert cache.put(b"c", owner, _outputs(100))
    assert cache.get(b"b") is None
    assert cache.get(b"a") is not None and cache.get(b"c") is not None
    assert (cache.evictions, len(cache.entries), cache.used) == (1, 2, 2 * _size(100))


def test_an_entry_larger_than_the_cache_is_not_stored_and_evicts_nothing() -> None:
    cache = ResponseCache(_size(100) + 10)
    owner = cache.open()
    assert cache.put(b"small", owner, _outputs(100))
    assert not cache.put(b"big", owner, _outputs(200))
    assert list(cache.entries) == [b"small"] and cache.evictions == 0


def test_cached_bytes_are_a_copy_of_the_response() -> None:
    cache = ResponseCache(1 << 20)
    owner = cache.open()
    data = bytearray(b"abcd")
    outputs = [OutputTensor("OUTPUT0", "UINT8", (4,), memoryview(data))]
    cache.put(b"k", owner, (outputs, {"p": 1}))
    data[:] = b"zzzz"
    entry = cache.get(b"k")
    assert entry is not None
    tensors, parameters = entry.outputs()
    assert (bytes(tensors[0].data or b""), parameters) == (b"abcd", {"p": 1})


def test_closing_an_owner_drops_its_entries_and_refuses_new_ones() -> None:
    cache = ResponseCache(1 << 20)
    first, second = cache.open(), cache.open()
    cache.put(b"1", first, _outputs(10))
    cache.put(b"2", second, _outputs(10))
    cache.close(first)
    assert list(cache.entries) == [b"2"] and cache.used == _size(10)
    assert not cache.put(b"3", first, _outputs(10))
    cache.close(second)
    assert (len(cache.entries), cache.used) == (0, 0)


def test_responses_the_server_does_not_hold_are_not_stored() -> None:
    cache = ResponseCache(1 << 20)
    owner = cache.open()
    in_region = [OutputTensor("OUTPUT0", "UINT8", (4,), None)]
    assert not cache.put(b"k", owner, (in_region, {}))
    assert cache.used == 0


def test_a_key_already_stored_is_kept_once() -> None:
    cache = ResponseCache(1 << 20)
    owner = cache.open()
    assert cache.put(b"k", owner, _outputs(10))
    assert not cache.put(b"k", owner, _outputs(10))
    assert cache.used == _size(10)


def test_cache_config_as_triton_spells_it() -> None:
    assert parse_cache_config([]) is None
    assert parse_cache_config(["local,size=1048576"]) == CacheSettings(1048576)
    assert dataclasses.astuple(parse_cache_config(["local,size=1", "local,size=2"]) or ()) == (2,)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (["redis,host=localhost"], "cache 'redis' is not available"),
        (["size=100"], "No cache specified"),
        (["local,size"], "--cache-config option format is"),
        (["local,size="], "--cache-config option format is"),
        (["local,size=abc"], "must be a number of bytes, got 'abc'"),
        (["local,size=-1"], "must be a number of bytes"),
        (["local,size=0"], "at least 1 byte"),
        (["local,size=1e6"], "must be a number of bytes"),
        ([f"local,size={1 << 62}"], "larger than this machine's memory"),
        (["local,bytes=10"], "no setting 'bytes'"),
        (["local,size=10", "redis,host=h"], "only a single cache is supported"),
    ],
)
def test_bad_cache_configs_are_refused(values: list[str], message: str) -> None:
    with pytest.raises(CacheConfigError, match=message):
        parse_cache_config(values)


def test_a_model_cache_hashes_large_inputs_on_a_thread_and_counts_as_triton() -> None:
    import asyncio

    from dlserve.server.core.cache.response_cache import HASH_ON_THREAD, ModelCache
    from dlserve.server.core.telemetry.stats import ModelStats

    stats = ModelStats("cached", "1")
    model = ModelCache(ResponseCache(4 * HASH_ON_THREAD), stats)
    big = np.ones((2, HASH_ON_THREAD // 4), dtype=np.float32)  # 2 x HASH_ON_THREAD bytes
    runs: list[int] = []

    async def run() -> tuple[list[OutputTensor], dict[str, object]]:
        runs.append(1)
        return [OutputTensor("OUTPUT0", "UINT8", (4,), b"abcd")], {}

    async def twice() -> list[tuple[list[OutputTensor], dict[str, object]]]:
        return [await model.outputs(_request(big), 0, run) for _ in range(2)]

    first, second = asyncio.run(twice())
    assert len(runs) == 1 and second[0][0].data == first[0][0].data == b"abcd"
    assert (stats.cache_hit.count, stats.cache_miss.count, stats.success.count) == (1, 1, 1)
    assert stats.inference_count == stats.execution_count == 0  # the run recorded nothing
    model.close()
    assert model.cache.used == 0


def test_a_model_cache_copies_large_outputs_on_a_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """A response with over COPY_ON_LOOP_LIMIT bytes to copy is copied into its entry off the
    event loop (the loop serves others meanwhile), a small one on it; both are copies."""
    import asyncio
    import threading

    from dlserve.server.core.cache import response_cache
    from dlserve.server.core.cache.response_cache import ModelCache
    from dlserve.server.core.telemetry.stats import ModelStats
    from dlserve.tensors.copies import COPY_ON_LOOP_LIMIT

    copied_on: dict[int, str] = {}
    original = response_cache._copied

    def watched(data: bytes | memoryview) -> bytes | memoryview:
        copied_on[memoryview(data).nbytes] = threading.current_thread().name
        return original(data)

    monkeypatch.setattr(response_cache, "_copied", watched)
    stats = ModelStats("cached", "1")
    model = ModelCache(ResponseCache(4 * COPY_ON_LOOP_LIMIT), stats)
    large, small = bytearray(b"\x01" * (COPY_ON_LOOP_LIMIT + 1)), bytearray(b"abcd")

    def answer(data: bytearray) -> Callable[[], Awaitable[Outputs]]:
        async def run() -> Outputs:
            return [OutputTensor("OUTPUT0", "UINT8", (len(data),), memoryview(data))], {}

        return run

    async def both() -> list[Outputs]:
        await model.outputs(_request(A), 0, answer(large))  # misses: run and stored
        await model.outputs(_request(A + 1), 0, answer(small))
        large[:1], small[:1] = b"\x02", b"z"  # the responses' buffers change afterwards
        return [await model.outputs(_request(A), 0, answer(large)),
                await model.outputs(_request(A + 1), 0, answer(small))]  # fmt: skip

    (cached_large, _), (cached_small, _) = asyncio.run(both())
    assert copied_on[4] == threading.current_thread().name != copied_on[COPY_ON_LOOP_LIMIT + 1]
    assert bytes(cached_large[0].data or b"")[:2] == b"\x01\x01"
    assert memoryview(cached_large[0].data or b"").readonly
    assert cached_small[0].data == b"abcd"
    assert (stats.cache_hit.count, stats.cache_miss.count) == (2, 2)
    model.close()
