"""How a generate request's values become tensors: ``spread`` over the model's dims."""

from __future__ import annotations

import pytest

from dlserve import errors
from dlserve.server.frontends.http.generate import spread


@pytest.mark.parametrize(
    ("count", "dims", "shape"),
    [
        (1, (), ()),
        (5, (-1,), (5,)),
        (6, (2, -1), (2, 3)),
        (4, (-1, -1), (1, 4)),  # the innermost -1 takes what is left
        (6, (-1, 3), (2, 3)),
        (3, (1, 3), (1, 3)),
        (0, (-1,), (0,)),
        (0, (0, 2), (0, 2)),
    ],
)
def test_spread(count: int, dims: tuple[int, ...], shape: tuple[int, ...]) -> None:
    assert spread("x", count, dims) == shape


@pytest.mark.parametrize(("count", "dims"), [(2, ()), (2, (3,)), (7, (2, -1)), (1, (0,))])
def test_what_cannot_be_spread(count: int, dims: tuple[int, ...]) -> None:
    with pytest.raises(errors.InvalidArgumentError, match="can not convert input 'x'"):
        spread("x", count, dims)
