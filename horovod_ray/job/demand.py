"""An elastic job's request to Ray's autoscaler, shared with every other job on the cluster.

Ray's ``request_resources`` is one standing request for the whole cluster: each call
replaces the last, whoever made it. So each job keeps its own demand in Ray's internal KV
(``horovod_ray/demand/<id>``, with a lease it renews while it runs), and whoever sends
sends them all, together with what another driver had asked for itself.

A send has two phases, recorded beside the demands: the request it is about to send
(``pending``), then, once Ray took it, that request as the one standing (``confirmed``).
A standing request that is neither is another driver's, and is kept as it stands; a send
that failed or died half way changes nothing that later sends rely on. Sends take a lock
in the same store; Ray's store has no compare-and-swap, so a lock whose holder was silent
for ``LOCK_S`` is broken, and only then can two sends overlap. A job that ends takes its
demand out and sends the rest; a driver that dies without doing so loses its demand at
the next send of any job after its lease ran out (with no other job, the last request
stands until another driver's call).

A driver that calls ``request_resources`` itself while a job sends may see its request
replaced once: it comes back as soon as it asks again, as after any other driver's call.
Under autoscaler v2, another driver's label selectors are not kept.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any, Mapping, Sequence

from horovod_ray.job.layouts import ElasticLayout

logger = logging.getLogger(__name__)

PREFIX = b"horovod_ray/demand/"  # one key per job; the value: its bundles and lease
RECORD_KEY = b"horovod_ray/demand"  # the send in flight, the request standing, the others
LOCK_KEY = b"horovod_ray/demand-lock"  # held while one job sends; its value: when it expires
LOCK_S = 15.0  # a lock held this long is taken as its holder's, dead, and broken
LOCK_WAIT_S = 20.0  # how long a send waits for the lock: past a dead holder's LOCK_S
LEASE_S = 60.0  # a job's demand counts this long after its driver last renewed it
RENEW_S = 15.0  # how often a running job renews its lease and sends again

Bundle = dict[str, float]


def combine(
    standing: Sequence[Bundle],
    record: Mapping[str, Any] | None,
    demands: Mapping[str, Mapping[str, Any]],
    now_s: float,
) -> tuple[list[Bundle], list[str], dict[str, Any]]:
    """The request to send. Pure.

    Args:
        standing: Ray's standing request now.
        record: ``{"pending": [...] or None, "confirmed": [...], "others": [...]}``, as
            the last send left it, or None. ``standing`` is ours if it is ``confirmed``
            (the last send that completed) or ``pending`` (a send that died after Ray
            took its request, before confirming it).
        demands: Job id -> ``{"bundles": [...], "until": s}`` (its lease's end).
        now_s: The time the leases are read at (seconds since the epoch).

    Returns:
        The request (other drivers' bundles, then each live job's), the jobs whose lease
        ran out (to drop), and the record to write before sending it (its ``pending``
        the request); once Ray took it, ``confirmed`` becomes the request.
    """
    if not isinstance(record, Mapping):
        record = {}  # none yet, or unreadable: what stands is another driver's
    ours = [record.get("confirmed"), record.get("pending")]
    if any(isinstance(r, list) and _same(standing, r) for r in ours):
        others = list(record.get("others") or [])
    else:
        others = list(standing)  # another driver asked since: theirs, as it stands
    live = {key: d for key, d in demands.items() if _live(d, now_s)}
    expired = sorted(set(demands) - set(live))
    request = others + [dict(b) for key in sorted(live) for b in live[key]["bundles"]]
    return request, expired, {"pending": request, "confirmed": list(standing), "others": others}


def _live(demand: Any, now_s: float) -> bool:
    """A job's demand whose lease has not run out; a malformed one is not."""
    try:
        return float(demand["until"]) > now_s and all(
            isinstance(b, dict) for b in demand["bundles"]
        )
    except (TypeError, KeyError, ValueError):
        return False


def _same(one: Sequence[Bundle], other: Sequence[Bundle]) -> bool:
    """The same bundles, in any order (Ray may group them), ``1`` being ``1.0``."""

    def canonical(bundles: Sequence[Bundle]) -> list[str]:
        return sorted(
            json.dumps({k: float(v) for k, v in b.items()}, sort_keys=True) for b in bundles
        )

    return canonical(one) == canonical(other)


class AutoscalerRequest:
    """This job's demand: room for ``max_workers`` ranks (``min_workers`` without it).

    The demand is the cluster's size the job needs, as ``request_resources`` takes it,
    so it covers the ranks already running and the missing ones.
    """

    def __init__(self, layout: ElasticLayout, per_rank: dict[str, float]) -> None:
        wanted = layout.max_workers or layout.min_workers
        self._bundles = [dict(per_rank)] * wanted
        self._key = PREFIX + uuid.uuid4().hex.encode()
        self._asked = False
        self._sent_at = -float("inf")

    def ask(self) -> None:
        """Adds this job's demand and sends every job's."""
        try:
            self._put()
            self._asked = True  # from here on, withdraw() takes it out
            self._send()
        except Exception:  # noqa: BLE001 - a hint; the job runs on what there is
            logger.warning("could not ask the autoscaler for room", exc_info=True)

    def renew(self) -> None:
        """Renews the lease and sends again, at most every ``RENEW_S`` (called often)."""
        if not self._asked or time.monotonic() - self._sent_at < RENEW_S:
            return
        try:
            self._put()
            self._send()
        except Exception:  # noqa: BLE001 - tried again at the next renewal
            logger.debug("renewing the autoscaler request failed", exc_info=True)

    def withdraw(self) -> None:
        """Takes this job's demand out and sends the rest."""
        if not self._asked:
            return
        from ray.experimental.internal_kv import _internal_kv_del

        self._asked = False
        try:
            _internal_kv_del(self._key)
            self._send()
        except Exception:  # noqa: BLE001 - Ray gone, or the lock held by a live job
            logger.warning(
                "could not take this job's demand out of the autoscaler request; the next "
                "send of another job will",
                exc_info=True,
            )

    def _put(self) -> None:
        from ray.experimental.internal_kv import _internal_kv_put

        value = {"bundles": self._bundles, "until": time.time() + LEASE_S}
        _internal_kv_put(self._key, json.dumps(value).encode(), overwrite=True)

    def _send(self) -> None:
        """Sends every job's demand and the other drivers' request, under the lock."""
        from ray.autoscaler.sdk import request_resources
        from ray.experimental.internal_kv import _internal_kv_del

        self._sent_at = time.monotonic()  # a failed send too: retried at the next renewal
        with _Lock():
            demands = {key: _read(key) for key in _keys()}
            standing = standing_request()
            request, expired, record = combine(standing, _read(RECORD_KEY), demands, time.time())
            for key in expired:
                _internal_kv_del(key.encode())
            _write(RECORD_KEY, record)
            request_resources(bundles=request)
            _write(RECORD_KEY, {**record, "pending": None, "confirmed": request})


def _keys() -> list[str]:
    from ray.experimental.internal_kv import _internal_kv_list

    return [key.decode() for key in _internal_kv_list(PREFIX)]


def _read(key: str | bytes) -> Any:
    """A JSON value of the store; None when absent or malformed."""
    from ray.experimental.internal_kv import _internal_kv_get

    raw = _internal_kv_get(key.encode() if isinstance(key, str) else key)
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return None


def _write(key: bytes, value: Any) -> None:
    from ray.experimental.internal_kv import _internal_kv_put

    _internal_kv_put(key, json.dumps(value).encode(), overwrite=True)


class _Lock:
    """The store-wide send lock: taken by a put that must not overwrite (its value a token
    and the time it is held since), released by a delete if the token is still ours; a
    lock held longer than ``LOCK_S`` is taken as its holder's, dead, and broken."""

    def __init__(self) -> None:
        self._token = uuid.uuid4().hex

    def __enter__(self) -> None:
        from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_put

        deadline = time.monotonic() + LOCK_WAIT_S
        seen: tuple[Any, float] | None = None  # (the holder's value, when first seen)
        while True:
            value = json.dumps([self._token]).encode()
            if not _internal_kv_put(LOCK_KEY, value, overwrite=False):
                return
            holder = _read(LOCK_KEY)
            if seen is None or seen[0] != holder:
                seen = (holder, time.monotonic())  # our own clock: no skew between drivers
            elif time.monotonic() - seen[1] > LOCK_S:
                _internal_kv_del(LOCK_KEY)  # held (or unreadable) this long: a dead holder
                seen = None
                continue
            if time.monotonic() > deadline:
                raise TimeoutError("another job held the autoscaler request's lock")
            time.sleep(0.05)

    def __exit__(self, *exc_info: object) -> None:
        from ray.experimental.internal_kv import _internal_kv_del

        if _read(LOCK_KEY) == [self._token]:
            _internal_kv_del(LOCK_KEY)


def standing_request() -> list[Bundle]:
    """Ray's standing autoscaler request, as ``request_resources`` last set it."""
    from ray.autoscaler.v2.utils import is_autoscaler_v2

    if is_autoscaler_v2():
        return _standing_request_v2()
    from ray._private.ray_constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
    from ray.experimental.internal_kv import _internal_kv_get

    raw = _internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL)
    return json.loads(raw) if raw else []


def _standing_request_v2() -> list[Bundle]:
    """Autoscaler v2 keeps the request in the GCS, as cluster resource constraints."""
    import ray
    from ray.autoscaler.v2.sdk import get_cluster_resource_state

    gcs = ray._private.worker.global_worker.gcs_client  # noqa: SLF001
    state = get_cluster_resource_state(gcs)
    bundles = []
    for constraint in state.cluster_resource_constraints:
        for request in constraint.resource_requests:
            for _ in range(request.count):
                bundles.append(dict(request.request.resources_bundle))
    return bundles
