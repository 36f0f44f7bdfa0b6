"""The registry of client system shared-memory regions, against real /dev/shm objects.

- register / status / unregister / unregister all, with Triton's codes and messages;
- keys refused: only slashes, Triton's reserved prefix, dlserve's own prefix, a symlink;
- bounds at registration and at inference, with huge values (no overflow in Python, but
  Triton's messages and checks all the same);
- in-flight counting: unregistering a region in use keeps it until its last request ends,
  then every worker that had it is told to unmap it;
- the policy: disabled, local peers only (the default), anyone.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from dlserve import errors
from dlserve.server.core.shm.registry import RegionRegistry, is_local
from dlserve.types import (
    InferRequest,
    InputTensor,
    Peer,
    RegionRef,
    RegionSpan,
    RegionStatus,
    RequestedOutput,
)

LOCAL = Peer("127.0.0.1")
REMOTE = Peer("10.1.2.3")


@pytest.fixture
def key() -> Iterator[str]:
    """A 4096-byte shared-memory object; its key as a client names it."""
    name = f"test_regions_{uuid.uuid4().hex}"
    path = Path("/dev/shm") / name
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, 4096)
    os.close(fd)
    try:
        yield "/" + name
    finally:
        path.unlink(missing_ok=True)


class FakeWorker:
    def __init__(self) -> None:
        self.unmapped: list[int] = []

    def unmap_regions(self, regions: list[int]) -> None:
        self.unmapped.extend(regions)


def request(
    inputs: dict[str, RegionRef], outputs: dict[str, RegionRef] | None = None, peer: Peer = LOCAL
) -> InferRequest:
    return InferRequest(
        "m", "", "id",
        [InputTensor(name, "FP32", (1,), None, {}, ref) for name, ref in inputs.items()],
        [RequestedOutput(name, {}, ref) for name, ref in (outputs or {}).items()],
        peer=peer,
    )  # fmt: skip


# -- register, status, unregister ---------------------------------------------------------
def test_register_status_unregister(key: str) -> None:
    registry = RegionRegistry()
    registry.register("b", key, 16, 100, LOCAL)
    registry.register("a", key, 0, 4096, LOCAL)
    assert registry.status() == [RegionStatus("a", key, 0, 4096), RegionStatus("b", key, 16, 100)]
    assert registry.status("b") == [RegionStatus("b", key, 16, 100)]
    registry.unregister("a", LOCAL)
    assert [r.name for r in registry.status()] == ["b"]
    registry.unregister("", LOCAL)  # "" is every region
    assert registry.status() == []


def test_unregistering_an_unknown_name_is_not_an_error() -> None:
    RegionRegistry().unregister("never", LOCAL)


def test_status_of_an_unknown_region() -> None:
    with pytest.raises(
        errors.NotFoundError, match="Unable to find system shared memory region: 'x'"
    ):
        RegionRegistry().status("x")


def test_a_taken_name(key: str) -> None:
    registry = RegionRegistry()
    registry.register("r", key, 0, 64, LOCAL)
    with pytest.raises(errors.AlreadyExistsError, match="shared memory region 'r' already in"):
        registry.register("r", key, 0, 64, LOCAL)


def test_a_name_is_needed(key: str) -> None:
    with pytest.raises(errors.InvalidArgumentError, match="'region name' is necessary"):
        RegionRegistry().register("", key, 0, 64, LOCAL)


@pytest.mark.parametrize("bad", ["/", "///"])
def test_keys_of_only_slashes(bad: str) -> None:
    with pytest.raises(
        errors.InvalidArgumentError,
        match=f"cannot register shared memory region 'r' - invalid shm key '{bad}'",
    ):
        RegionRegistry().register("r", bad, 0, 64, LOCAL)


@pytest.mark.parametrize("prefix", ["triton_python_backend_shm_region_", "dlserve_"])
@pytest.mark.parametrize("slashes", ["", "/", "///"])
def test_reserved_prefixes(prefix: str, slashes: str) -> None:
    bad = f"{slashes}{prefix}x"
    with pytest.raises(errors.InvalidArgumentError) as info:
        RegionRegistry().register("r", bad, 0, 64, LOCAL)
    assert info.value.message == (
        f"cannot register shared memory region 'r' with key '{bad}' as the key contains the "
        f"reserved prefix '{prefix}'"
    )


@pytest.mark.parametrize("bad", ["/no_such_object_for_dlserve", "/a/b", "/..", "."])
def test_keys_that_cannot_be_opened(bad: str) -> None:
    with pytest.raises(errors.InternalError, match=f"Unable to open shared memory region: '{bad}'"):
        RegionRegistry().register("r", bad, 0, 1, LOCAL)


def test_a_symlink_is_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "secret"
    target.write_bytes(b"x" * 64)
    link = Path("/dev/shm") / f"test_regions_link_{uuid.uuid4().hex}"
    link.symlink_to(target)
    try:
        with pytest.raises(errors.InternalError, match="Unable to open shared memory region"):
            RegionRegistry().register("r", "/" + link.name, 0, 64, LOCAL)
    finally:
        link.unlink()


@pytest.mark.parametrize(
    ("offset", "byte_size"),
    [(0, 4097), (1, 4096), (4096, 1), (4097, 0), (2**63 - 1, 2), (2**63, 2**63), (2**64 - 1, 1),
     (-1, 8), (0, -1)],
)  # fmt: skip
def test_registered_range_must_be_in_the_object(key: str, offset: int, byte_size: int) -> None:
    with pytest.raises(
        errors.InvalidArgumentError, match="failed to register shared memory region 'r': invalid"
    ):
        RegionRegistry().register("r", key, offset, byte_size, LOCAL)


@pytest.mark.parametrize(("offset", "byte_size"), [(4096, 0), (4095, 1), (1, 4095), (3, 10)])
def test_any_range_in_the_object_registers(key: str, offset: int, byte_size: int) -> None:
    registry = RegionRegistry()
    registry.register("r", key, offset, byte_size, LOCAL)  # unaligned offsets too
    assert registry.status("r") == [RegionStatus("r", key, offset, byte_size)]


# -- inference ----------------------------------------------------------------------------
def test_spans_are_offsets_in_the_object(key: str) -> None:
    registry = RegionRegistry()
    registry.register("r", key, 100, 200, LOCAL)
    lease = registry.lease(request({"A": RegionRef("r", 8, 3)}, {"X": RegionRef("r", 50, 150)}))
    assert lease is not None
    region_id = lease.inputs["A"].region_id
    assert lease.inputs == {"A": RegionSpan(region_id, key, 103, 8)}
    assert lease.outputs == {"X": RegionSpan(region_id, key, 250, 50)}
    registry.release(lease)


def test_a_request_without_regions_takes_no_lease() -> None:
    plain = InferRequest("m", "", "", [InputTensor("A", "FP32", (1,), memoryview(b"abcd"))], [])
    assert RegionRegistry().lease(plain) is None


@pytest.mark.parametrize(
    ("ref", "error", "message"),
    [
        (RegionRef("nope", 4), errors.NotFoundError, "Unable to find shared memory region: 'nope'"),
        (RegionRef("r", 4, 64), errors.InvalidArgumentError,
         "Invalid offset for shared memory region: 'r'"),
        (RegionRef("r", 4, -1), errors.InvalidArgumentError,
         "Invalid offset for shared memory region: 'r'"),
        (RegionRef("r", 2**64 - 32, 32), errors.InvalidArgumentError,
         "Integer overflow detected: byte_size (18446744073709551584) + offset (32) exceeds "
         "maximum value (18446744073709551615) for region 'r'"),
        (RegionRef("r", 64, 1), errors.InvalidArgumentError,
         "Invalid offset + byte size for shared memory region: 'r'"),
        (RegionRef("r", 2**63 - 1, 1), errors.InvalidArgumentError,
         "Invalid offset + byte size for shared memory region: 'r'"),
        (RegionRef("r", -1, 1), errors.InvalidArgumentError,
         "Invalid offset + byte size for shared memory region: 'r'"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("cuda", [False, True])
def test_spans_are_checked(
    key: str, ref: RegionRef, error: type[errors.DlserveError], message: str, cuda: bool
) -> None:
    """The same checks and messages for a system region and a CUDA one (whose handle the
    registry takes as checked: no GPU is needed to check a span)."""
    registry = RegionRegistry()
    if cuda:
        registry.add_cuda("r", b"\0" * 64, 0, 64)
    else:
        registry.register("r", key, 0, 64, LOCAL)
    for tensors in ({"A": ref}, {}):
        outputs = {} if tensors else {"X": ref}
        with pytest.raises(error) as info:
            registry.lease(request(tensors, outputs))
        assert info.value.message == message
    registry.unregister("r", LOCAL, cuda)  # a failed lease counted nothing: it goes at once
    assert registry.status(cuda=cuda) == []


def test_unregistering_a_region_in_use(key: str) -> None:
    registry = RegionRegistry()
    registry.register("r", key, 0, 64, LOCAL)
    registry.register("other", key, 0, 64, LOCAL)
    worker, idle = FakeWorker(), FakeWorker()
    first = registry.lease(request({"A": RegionRef("r", 4)}, {"X": RegionRef("r", 4, 4)}))
    assert first is not None
    first.bind(worker)
    registry.unregister("", LOCAL)  # succeeds at once
    assert [r.name for r in registry.status()] == ["r"]  # "other" was idle: gone already
    with pytest.raises(errors.AlreadyExistsError):
        registry.register("r", key, 0, 64, LOCAL)
    second = registry.lease(request({"A": RegionRef("r", 4)}))  # still usable, as in Triton
    assert second is not None
    second.bind(idle)
    registry.release(first)
    assert registry.status("r") and worker.unmapped == []
    registry.release(second)
    assert registry.status() == []
    region_id = first.inputs["A"].region_id
    assert worker.unmapped == [region_id] and idle.unmapped == [region_id]


def test_unregistering_an_idle_region_unmaps_it_where_it_was_used(key: str) -> None:
    registry = RegionRegistry()
    registry.register("r", key, 0, 64, LOCAL)
    worker = FakeWorker()
    lease = registry.lease(request({"A": RegionRef("r", 4)}))
    assert lease is not None
    lease.bind(worker)
    registry.release(lease)
    assert worker.unmapped == []  # still registered: the worker keeps its mapping
    registry.unregister("r", LOCAL)
    assert worker.unmapped == [lease.inputs["A"].region_id]


def test_a_new_registration_under_the_same_name_is_a_new_region(key: str) -> None:
    registry = RegionRegistry()
    ids = []
    for _ in range(2):
        registry.register("r", key, 0, 64, LOCAL)
        lease = registry.lease(request({"A": RegionRef("r", 4)}))
        assert lease is not None
        ids.append(lease.inputs["A"].region_id)
        registry.release(lease)
        registry.unregister("r", LOCAL)
    assert ids[0] != ids[1]  # workers cache by id: a stale mapping is never reused


# -- policy -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("peer", "local"),
    [(Peer(None), True), (Peer("127.0.0.1"), True), (Peer("127.3.4.5"), True),
     (Peer("::1"), True), (Peer("::ffff:127.0.0.1"), True), (Peer("10.0.0.1"), False),
     (Peer("192.168.1.1"), False), (Peer("::ffff:10.0.0.1"), False), (Peer("fe80::1"), False),
     (Peer(""), False), (Peer("localhost"), False), (None, False)],
)  # fmt: skip
def test_is_local(peer: Peer | None, local: bool) -> None:
    assert is_local(peer) is local


def test_disabled(key: str) -> None:
    registry = RegionRegistry("false")
    for call in (lambda: registry.register("r", key, 0, 64, LOCAL),
                 lambda: registry.unregister("r", Peer(None))):  # fmt: skip
        with pytest.raises(errors.UnsupportedError, match="Client shared memory is disabled"):
            call()
    assert registry.status() == []


def test_local_only_by_default(key: str) -> None:
    registry = RegionRegistry()
    with pytest.raises(errors.UnsupportedError, match=r"local clients only.*'10\.1\.2\.3'"):
        registry.register("r", key, 0, 64, REMOTE)
    registry.register("r", key, 0, 64, Peer(None))
    with pytest.raises(errors.UnsupportedError, match="local clients only"):
        registry.unregister("r", REMOTE)
    with pytest.raises(errors.UnsupportedError, match="local clients only"):
        registry.lease(request({"A": RegionRef("r", 4)}, peer=REMOTE))
    assert registry.status("r")


def test_anyone_when_allowed(key: str) -> None:
    registry = RegionRegistry("any")
    registry.register("r", key, 0, 64, REMOTE)
    lease = registry.lease(request({"A": RegionRef("r", 4)}, peer=REMOTE))
    assert lease is not None
    registry.release(lease)
    registry.unregister("r", REMOTE)


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="allow_client_shm"):
        RegionRegistry("sometimes")  # type: ignore[arg-type]
