"""The rendezvous server's keys, as horovod's store keeps them, and its held reads.

Keys live under scopes. A registered scope (global, local_<host>, cross_<local rank>) is
cleared once each of its members has sent its closing DELETE (horovod's own server
cleared every scope's count there, so a scope could keep stale keys into the next
``hvd.init``); an unregistered scope drops the deleted key. A batched read waits for its
missing keys as a future that the last of them resolves.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import threading
from typing import Iterable, Sequence

logger = logging.getLogger("horovod_ray.rendezvous.server")

# Longest a batched read is held waiting for its keys; the client then asks again
# (until its Gloo timeout). Each ask costs a scan of its keys: with 2 s, a 4096-rank
# scope was asked again some 6,000 times. Shorter for ranks whose Gloo timeout is not a
# multiple of it (hold_for): the client looks at its clock only when an answer comes, so a
# hold that outlasts its timeout made a rank whose peer never came fail that much late.
BATCH_HOLD_S = 10.0


def gloo_seconds(timeout_s: float) -> int:
    """HOROVOD_GLOO_TIMEOUT_SECONDS for a job's ``timeout_s`` (> 0): the ranks wait whole
    seconds."""
    return math.ceil(timeout_s)


def hold_for(gloo_timeout_s: float | None) -> float:
    """How long the server holds a batched read for ranks with this Gloo timeout: the
    ranks' whole seconds (:func:`gloo_seconds`) in equal holds of at most BATCH_HOLD_S,
    so that the last one ends when their timeout does (15 s: two of 7.5)."""
    if gloo_timeout_s is None:
        return BATCH_HOLD_S
    seconds = gloo_seconds(gloo_timeout_s)
    return seconds / math.ceil(seconds / BATCH_HOLD_S)


GLOBAL_SCOPE = "global"


class _Waiter:
    """A held batched read: its future resolves when the last of its keys arrives."""

    __slots__ = ("missing", "future")

    def __init__(self, missing: int, future: asyncio.Future) -> None:
        self.missing = missing
        self.future = future


class Store:
    """Scopes of keys. Only the event loop's thread touches it, except :meth:`joined`."""

    def __init__(self, verbose: bool = False, hold_s: float = BATCH_HOLD_S) -> None:
        # verbose: scope changes at INFO, not DEBUG (``settings.verbose >= 2``).
        self.hold_s = hold_s
        self._log_level = logging.INFO if verbose else logging.DEBUG
        self.scopes: dict[str, dict[str, bytes]] = {}
        self.scope_size: dict[str, int] = {}
        self._finished: dict[str, set[str]] = collections.defaultdict(set)
        # scope -> key -> batched reads held until that key arrives (by id, so that a
        # read given up on leaves in O(1)).
        self._waiters: dict[str, dict[str, dict[int, _Waiter]]] = {}
        self._joined_lock = threading.Lock()
        self._joined: set[int] = set()

    def register(self, scope_size: dict[str, int]) -> None:
        """A new world: every key goes, held reads are answered, scope sizes are set."""
        self.scopes.clear()
        self._finished.clear()
        self.scope_size = dict(scope_size)
        self.release_waiters()
        logger.log(self._log_level, "rendezvous: a new world, scopes %s", self.scope_size)

    def note_join(self, rank: int) -> None:
        with self._joined_lock:
            self._joined.add(rank)

    def joined(self) -> set[int]:
        with self._joined_lock:
            return set(self._joined)

    def get(self, scope: str, key: str) -> bytes | None:
        return self.scopes.get(scope, {}).get(key)

    def put(self, scope: str, keys: Sequence[str], values: Sequence[bytes]) -> None:
        """Stores keys and wakes the reads that were waiting for them."""
        self.scopes.setdefault(scope, {}).update(zip(keys, values, strict=True))
        waiters = self._waiters.get(scope)
        if not waiters:
            return
        for key in waiters.keys() & set(keys):
            for waiter in waiters.pop(key).values():
                waiter.missing -= 1
                if waiter.missing == 0 and not waiter.future.done():
                    waiter.future.set_result(True)

    def delete(self, scope: str, key: str) -> None:
        """A member's closing DELETE (registered scopes) or a key's removal (others)."""
        if scope in self.scope_size:
            finished = self._finished[scope]
            finished.add(key)
            if len(finished) >= self.scope_size[scope]:
                self.scopes.pop(scope, None)
                del self._finished[scope]
                logger.log(self._log_level, "rendezvous: scope %s cleared", scope)
            return
        values = self.scopes.get(scope)
        if values is not None:
            values.pop(key, None)
            if not values:
                del self.scopes[scope]

    async def get_many(self, scope: str, keys: list[str]) -> list[bytes] | None:
        """The keys' values once all are present; None if some are still missing after
        ``hold_s`` (the client asks again, or gives up at its timeout)."""
        values = self.scopes.get(scope, {})
        # Each key once: a key asked for twice arrives once.
        missing = list(dict.fromkeys(key for key in keys if key not in values))
        if missing:
            waiter = _Waiter(len(missing), asyncio.get_running_loop().create_future())
            waiters = self._waiters.setdefault(scope, {})
            for key in missing:
                waiters.setdefault(key, {})[id(waiter)] = waiter
            try:
                complete = await asyncio.wait_for(waiter.future, self.hold_s)
            except TimeoutError:
                complete = False
            if not complete:
                self._forget(scope, missing, waiter)
                return None
            values = self.scopes.get(scope, {})
        try:
            return [values[key] for key in keys]
        except KeyError:  # the scope was cleared meanwhile (a new elastic world)
            return None

    def _forget(self, scope: str, keys: Iterable[str], waiter: _Waiter) -> None:
        # A read given up on leaves the index, so nothing grows between a client's asks.
        waiters = self._waiters.get(scope, {})
        for key in keys:
            held = waiters.get(key)
            if held is not None and held.pop(id(waiter), None) is not None and not held:
                del waiters[key]
        if not waiters:
            self._waiters.pop(scope, None)

    def release_waiters(self) -> None:
        """Ends every held read now: a new elastic world (each is answered 404, and
        asked again), or stop (whose connections are then dropped)."""
        held, self._waiters = self._waiters, {}
        for waiters in held.values():
            for queue in waiters.values():
                for waiter in queue.values():
                    if not waiter.future.done():
                        waiter.future.set_result(False)

    def held(self) -> int:
        """Batched reads waiting now (for tests and logs)."""
        return len({held for ws in self._waiters.values() for q in ws.values() for held in q})
