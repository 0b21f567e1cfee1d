"""Reported metrics as a run stores them: checked at ``report()``, stored as JSON, and
flattened with "/" to find the score that ranks checkpoints (as Ray Train does)."""

from __future__ import annotations

import json
from typing import Mapping

from horovod_ray.errors import ConfigError


def checked_metrics(metrics: object) -> dict:
    """``metrics`` as a dict, checked: a mapping whose keys, nested mappings' too, are str.

    Raises:
        ConfigError: Naming the first key that is not a str, by its path.
    """
    if not isinstance(metrics, Mapping):
        raise ConfigError(
            "metrics",
            f"report() takes a dict such as {{'loss': 0.3}}, got {type(metrics).__name__}",
        )
    # Each mapping with the ids of those it is nested in: one dict may appear twice (JSON
    # writes it twice), but not inside itself.
    pending: list[tuple[tuple, Mapping, frozenset]] = [((), metrics, frozenset())]
    while pending:
        path, mapping, outer = pending.pop()
        if id(mapping) in outer:
            raise ConfigError("metrics", "metrics holds itself (a dict nested in itself)")
        outer = outer | {id(mapping)}
        for key, value in mapping.items():
            if not isinstance(key, str):
                where = "/".join(path) or "the top level"
                raise ConfigError(
                    "metrics",
                    f"metrics keys must be str, got {key!r} ({type(key).__name__}) at {where}: "
                    f"name it with a str, e.g. {str(key)!r}",
                )
            if isinstance(value, Mapping):
                pending.append(((*path, key), value, outer))
    return dict(metrics)


def flatten(metrics: Mapping) -> dict:
    """Nested metrics as one level, their paths joined with "/" (as Ray Train's
    ``flatten_dict``): ``{"val": {"loss": 0.2}}`` is ``{"val/loss": 0.2}``."""
    flat = {}
    for key, value in metrics.items():
        if isinstance(value, Mapping) and value:
            for inner, leaf in flatten(value).items():
                flat[f"{key}/{inner}"] = leaf
        else:
            flat[key] = value
    return flat


def plain(metrics: dict) -> dict:
    """``metrics`` as they will be stored and read back (JSON; see :func:`_plain`).

    Raises:
        ConfigError: They cannot be stored (a list holding a dict with keys of mixed
            types, say), with JSON's reason.
    """
    try:
        return json.loads(encoded(metrics))
    except (TypeError, ValueError) as err:
        raise ConfigError(
            "metrics", f"metrics cannot be stored as JSON: {type(err).__name__}: {err}"
        ) from err


def encoded(value: dict) -> bytes:
    """``value`` as the JSON stored (see :func:`_plain` for values JSON has no type for)."""
    return json.dumps(value, default=_plain, sort_keys=True).encode()


def _plain(value: object) -> object:
    """A metric JSON cannot hold as it is: a NumPy or framework scalar as its number
    (``.item()``), anything else as its ``repr``."""
    item = getattr(value, "item", None)
    if callable(item):
        try:
            plain = item()
        except Exception:  # noqa: BLE001 - not one number (a tensor of several values)
            return repr(value)
        if isinstance(plain, (bool, int, float, str)) or plain is None:
            return plain
    return repr(value)
