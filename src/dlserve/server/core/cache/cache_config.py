"""Triton's response-cache settings: ``--cache-config`` and a model's ``response_cache``.

``--cache-config <cache>,<setting>=<value>`` may be given more than once (one setting
each), as Triton's. dlserve has one cache implementation, Triton's ``local`` (an LRU of
responses in the server's memory, bounded in bytes by ``size``); any other name, a second
cache, a setting ``local`` does not have, or a size that is not a whole number of bytes
between 1 and the machine's memory is refused when the server starts, with the reason.

A model's ``response_cache { enable: true }`` is checked when it loads
(``server/core/models/config.py``), as Triton's ``ValidateModelConfig`` checks it, whether or not
the server has a cache: a decoupled model or one with the sequence batcher is refused. An ensemble
that enables it is refused when one of its steps (at any depth) is such a model, as Triton's
documentation says an ensemble inherits its steps' limits: a cached answer of a stateful step would
be wrong.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from dlserve.errors import InvalidArgumentError

LOCAL: Final = "local"
_FORMAT: Final = "--cache-config option format is '<cache name>,<setting>=<value>'"


class CacheConfigError(ValueError):
    """A ``--cache-config`` value the server refuses to start with."""


@dataclass(frozen=True, slots=True)
class CacheSettings:
    """The server's cache: Triton's ``local`` cache of ``size`` bytes."""

    size: int


def parse_cache_config(values: Sequence[str]) -> CacheSettings | None:
    """The cache the ``--cache-config`` values ask for; None when there are none."""
    if not values:
        return None
    settings: dict[str, str] = {}
    names: set[str] = set()
    for value in values:
        name, setting, text = _split(value)
        names.add(name)
        settings[setting] = text
    if len(names) > 1:
        raise CacheConfigError(
            f"found multiple cache configurations ({', '.join(sorted(names))}), but only a "
            "single cache is supported"
        )
    (name,) = names
    if name != LOCAL:
        raise CacheConfigError(
            f"cache '{name}' is not available: dlserve has only Triton's 'local' cache "
            f"(--cache-config local,size=BYTES)"
        )
    unknown = sorted(set(settings) - {"size"})
    if unknown:
        raise CacheConfigError(
            f"the local cache has no setting '{unknown[0]}' (it takes only 'size', in bytes)"
        )
    if "size" not in settings:
        raise CacheConfigError("the local cache needs a size: --cache-config local,size=BYTES")
    return CacheSettings(_size(settings["size"]))


def _split(value: str) -> tuple[str, str, str]:
    """``<cache>,<setting>=<value>`` in its parts, refused as Triton refuses a bad one."""
    name, comma, rest = value.partition(",")
    if not comma or not name:
        raise CacheConfigError(
            f"No cache specified. --cache-config option format is "
            f"<cache name>,<setting>=<value>. Got {value}"
        )
    setting, equals, text = rest.partition("=")
    if not equals or not setting or not text:
        raise CacheConfigError(f"{_FORMAT}. Got {value}")
    return name, setting, text


def _size(text: str) -> int:
    if not text.isascii() or not text.isdigit():
        raise CacheConfigError(f"the local cache's size must be a number of bytes, got '{text}'")
    size = int(text)
    if size <= 0:
        raise CacheConfigError("the local cache's size must be at least 1 byte")
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if size > memory:
        raise CacheConfigError(
            f"the local cache's size ({size} bytes) is larger than this machine's memory "
            f"({memory} bytes)"
        )
    return size


def check_ensemble_steps(name: str, config: Any, config_of: Callable[[str], Any]) -> None:
    """Refuse the cache of ensemble ``name`` if a step (at any depth) could not use one;
    ``config_of``: a loaded model's config."""
    for step in config.ensemble_scheduling.step:
        step_config = config_of(step.model_name)
        if step_config.platform == "ensemble":
            check_ensemble_steps(name, step_config, config_of)
            continue
        if step_config.HasField("sequence_batching"):
            why = "uses the sequence batching scheduler"
        elif step_config.model_transaction_policy.decoupled:
            why = "uses the 'decoupled' transaction policy"
        else:
            continue
        raise InvalidArgumentError(
            f"Response Cache does not currently support ensemble {name}: its step model "
            f"'{step.model_name}' {why}. Please disable the response cache."
        )
