"""Rank 0's ``log()`` dicts on their way to the driver's callbacks: both halves.

On the rank, :func:`log` queues a dict in rank 0's :class:`LogChannel` (other ranks drop
it, so training code needs no rank check). On the driver, :func:`collect` long-polls rank
0's channel (``Worker.next_logs``, in the actor's control group, so it answers while user
code runs) and hands each dict to the callbacks while the call is still running.

``log()`` does not wait. :func:`post_and_wait_delivered` (a Tune trial's reports) waits
until the driver's callbacks have returned from its item: :func:`collect` hands a poll's
items to the callbacks before it sends the next poll, so the next poll proves them
delivered.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
from typing import Any, Callable, Iterable, Mapping

import ray

from horovod_ray.errors import ConfigError
from horovod_ray.rank import session

# Longest a driver-side wait for rank 0's log() dicts lasts before it is renewed.
LOG_POLL_S = 5.0
# How often a wait that may be ended (an elastic slot's) checks whether it should end.
CHECK_S = 0.1


class _Delivery:
    """An item's poster waits for this: set once the driver has delivered the item."""

    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = False


class LogChannel:
    """Dicts logged by user code on rank 0, waiting for the driver to collect them.

    Calls are numbered and each dict is tagged with the call that logged it, so a poll for
    call ``n`` never returns what an earlier call left behind (those had no callbacks to
    go to). The poll for call ``n`` returns at once when call ``n`` has finished, so the
    last dicts never wait for the poll to time out.

    An item put with :meth:`put_and_wait_delivered` carries a :class:`_Delivery`: the
    poll that hands it to the driver keeps it, and the driver's next poll for the same
    call marks it done (the driver delivers a poll's items before it polls again).
    """

    def __init__(self) -> None:
        self._items: collections.deque = collections.deque()  # (call, item, delivery)
        self._ready = threading.Condition()
        self._current_call = 0
        self._finished_call = 0
        # Per call: the deliveries the last poll handed to the driver, not yet done.
        self._handed: dict[int, list[_Delivery]] = {}

    def begin(self, call_id: int) -> None:
        with self._ready:
            self._current_call = call_id
            # An earlier call's last items were never polled for again: nobody waits on them.
            self._handed = {}

    def end(self, call_id: int) -> None:
        with self._ready:
            self._finished_call = max(self._finished_call, call_id)
            self._ready.notify_all()

    def put(self, item: object, delivery: _Delivery | None = None) -> None:
        with self._ready:
            self._items.append((self._current_call, item, delivery))
            self._ready.notify_all()

    def put_and_wait_delivered(self, item: object) -> None:
        """Puts ``item``, then waits until the driver has delivered it."""
        delivery = _Delivery()
        self.put(item, delivery)
        with self._ready:
            self._ready.wait_for(lambda: delivery.done)

    def wait_taken(self) -> None:
        """Waits until the driver has taken every item."""
        with self._ready:
            self._ready.wait_for(lambda: not self._items)

    def take(self, call_id: int, timeout_s: float) -> tuple[list[dict], bool]:
        with self._ready:
            # This poll proves that the driver delivered what its last one took.
            for delivery in self._handed.pop(call_id, ()):
                delivery.done = True
            self._ready.notify_all()
            self._ready.wait_for(
                lambda: (
                    self._finished_call >= call_id
                    or any(tag == call_id for tag, _, _ in self._items)
                ),
                timeout=timeout_s,
            )
            taken = [(item, d) for tag, item, d in self._items if tag == call_id]
            self._items = collections.deque(entry for entry in self._items if entry[0] > call_id)
            handed = [delivery for _, delivery in taken if delivery is not None]
            if handed:
                self._handed[call_id] = handed
            self._ready.notify_all()  # for wait_taken
            return [item for item, _ in taken], self._finished_call >= call_id


def rank_now() -> int:
    """This process's rank now: horovod's (an elastic reset may change it) or its first."""
    return _horovod_now("rank", "HOROVOD_RANK", 0)


def size_now() -> int:
    """The world's size now: horovod's (an elastic reset may change it) or the job's first."""
    return _horovod_now("size", "HOROVOD_SIZE", 1)


def _horovod_now(what: str, env: str, default: int) -> int:
    """``hvd.<what>()`` of whichever framework's horovod is initialised, else ``env``."""
    for name in ("horovod.tensorflow", "horovod.torch"):
        module = sys.modules.get(name)
        if module is not None:
            try:
                return int(getattr(module, what)())
            except Exception:  # noqa: BLE001 - not initialised under that framework
                continue
    return int(os.environ.get(env, str(default)))


def log(metrics: Mapping[str, Any]) -> None:
    """Reports a dict of metrics from inside a worker to the driver's callbacks.

    Only rank 0's dicts are delivered (every rank may call it, so training code needs no
    rank check); they reach each callback given to ``execute``/``run``, in order, while
    the call is still running. Outside a horovod_ray worker this does nothing.

    Args:
        metrics: Picklable values keyed by name, e.g. ``{"epoch": 1, "loss": 0.3}``.

    Raises:
        ConfigError: ``metrics`` is not a mapping.
    """
    if not isinstance(metrics, Mapping):
        raise ConfigError(
            "metrics", f"log() takes a dict such as {{'loss': 0.3}}, got {type(metrics).__name__}"
        )
    post(dict(metrics))


def log_any_rank(metrics: Mapping[str, Any]) -> None:
    """As :func:`log`, from whichever rank calls it in an elastic job (every rank's dicts
    reach the callbacks there, as horovod.ray's ``ray_logger.log``); rank 0's in a static
    job.

    Raises:
        ConfigError: ``metrics`` is not a mapping.
    """
    if not isinstance(metrics, Mapping):
        raise ConfigError(
            "info_dict",
            f"ray_logger.log() takes a dict such as {{'loss': 0.3}}, got {type(metrics).__name__}",
        )
    channel = session.current().channel
    if channel is not None:
        channel.put(dict(metrics))


def post(item: object) -> None:
    """Queues ``item`` for the driver if this process is rank 0 of a job, else drops it."""
    now = session.current()
    channel = now.channel
    if channel is not None and (not now.elastic or rank_now() == 0):
        channel.put(item)


def post_and_wait_delivered(item: object) -> None:
    """As :func:`post`, then waits until the driver's callbacks have returned from
    ``item``: at most one item is in flight, however fast the caller posts.

    Only for a call whose driver collects rank 0's items (a call given callbacks): else
    nothing delivers it, and the caller waits until the job is stopped. A driver whose
    callback raised stops polling, and the job is then stopped with the caller in here.
    """
    now = session.current()
    channel = now.channel
    if channel is not None and (not now.elastic or rank_now() == 0):
        channel.put_and_wait_delivered(item)


def post_and_wait(item: object) -> None:
    """Queues ``item`` from any rank of an elastic job (each slot's channel is polled by
    its own driver thread) and waits until the driver has taken it.

    Raises:
        RuntimeError: Not in a rank of an elastic job (there is no channel).
    """
    channel = session.current().channel
    if channel is None:
        raise RuntimeError("post_and_wait() runs only in a rank of an elastic job")
    channel.put(item)
    channel.wait_taken()


def open_channel(is_log_rank: bool) -> None:
    """Opens this process's channel if it is rank 0 (closes it otherwise); in an elastic
    job (``HOROVOD_ELASTIC`` set) on every rank, which posts while it is rank 0."""
    now = session.current()
    now.elastic = os.environ.get("HOROVOD_ELASTIC") == "1"
    now.channel = LogChannel() if is_log_rank or now.elastic else None


def begin(call_id: int) -> None:
    """Marks the start of call ``call_id``: what is logged now belongs to it."""
    channel = session.current().channel
    if channel is not None:
        channel.begin(call_id)


def end(call_id: int) -> None:
    """Marks the end of call ``call_id``: the driver's poll for it returns."""
    channel = session.current().channel
    if channel is not None:
        channel.end(call_id)


def take(call_id: int, timeout_s: float) -> tuple[list[dict], bool]:
    """The rank's half of the long-poll: dicts of call ``call_id``, and whether it ended."""
    channel = session.current().channel
    if channel is None:
        return [], True
    return channel.take(call_id, timeout_s)


# ------------------------------------------------------------------------ driver's half


class Callback:
    """A driver-side callback for ``run()``/``execute()`` that also hears of an elastic
    job's changes of membership. Subclass it, or give any callable an ``on_membership``
    method: a plain callable gets only the dicts ranks log, as horovod.ray's did.
    """

    def __call__(self, item: dict) -> None:
        """Gets each dict rank 0 passes to ``log()`` (and, in an elastic job, any rank to
        ``ray_logger.log()``), in order, while the call runs."""

    def on_membership(self, change: dict) -> None:
        """Gets each change of an elastic job's membership (``event``: ``"membership"``,
        ``size_before``, ``size_after``, ``nodes_added``, ``nodes_removed``,
        ``ranks_added``, ``ranks_removed``, ``reset``), the first world's included."""


def to_all(callbacks: Iterable[Callable[[dict], None]]) -> Callable[[dict], None]:
    """One delivery that hands each dict to every callback, in order."""
    callbacks = list(callbacks)

    def deliver(item: dict) -> None:
        for callback in callbacks:
            callback(item)

    return deliver


def to_membership_hooks(callbacks: Iterable[Callable[[dict], None]]) -> Callable[[dict], None]:
    """One delivery that hands each change of membership to every callback that asks
    for them (an ``on_membership`` method), in order."""
    hooks = [getattr(callback, "on_membership", None) for callback in callbacks]
    return to_all(hook for hook in hooks if callable(hook))


def collect(
    rank0: Any,
    refs: list[ray.ObjectRef],
    deliver: Callable[[dict], None],
    call_id: int,
    check: Callable[[], None] | None = None,
) -> list[Any]:
    """Waits for ``refs`` while delivering rank 0's dicts of call ``call_id``.

    Args:
        rank0: The actor whose channel is polled (an elastic slot polls its own).
        refs: The call's refs, one per rank.
        deliver: Gets each dict, in order, while the call runs.
        call_id: The call whose dicts are wanted.
        check: Called every ~0.1 s; whatever it raises ends the wait (an elastic slot
            that horovod's driver lets go).

    Raises:
        ray.exceptions.RayError: As soon as a rank failed.
    """
    poll_s = None if check is None else CHECK_S
    poll = rank0.next_logs.remote(call_id, LOG_POLL_S)
    pending = list(refs)
    while pending:
        ready, _ = ray.wait([poll, *pending], num_returns=1, timeout=poll_s)
        if ready and ready[0] == poll:
            items, finished = ray.get(poll)
            for item in items:
                deliver(item)
            # Only now: this poll tells rank 0 that those items were delivered.
            poll = rank0.next_logs.remote(call_id, 0 if finished else LOG_POLL_S)
        elif ready:
            pending = [ref for ref in pending if ref != ready[0]]
            ray.get(ready[0])  # raises at once when that rank failed
        if check is not None and pending:
            # Every pass, not only on a timeout: a rank that logs often answers each poll
            # within it. Not once every rank has returned: the call is done.
            check()
    for item in remaining(rank0, poll, call_id):
        deliver(item)
    return ray.get(refs)


def wait_all(refs: list[ray.ObjectRef], check: Callable[[], None]) -> list[Any]:
    """Every ref's value, as :func:`collect` without a channel to poll: ``check`` is
    called between waits of up to ``CHECK_S``.

    Raises:
        ray.exceptions.RayError: Within ``CHECK_S`` of a ref holding an error.
    """
    pending = list(refs)
    while pending:
        # All at once: a short call is one wait (B3); a failed rank is seen within CHECK_S.
        ready, pending = ray.wait(pending, num_returns=len(pending), timeout=CHECK_S)
        if ready:
            ray.get(ready)  # raises when a rank failed
        if pending:  # not once every rank has returned: the call is done
            check()
    return ray.get(refs)


def remaining(rank0: Any, poll: ray.ObjectRef | None, call_id: int) -> list[dict]:
    """Rank 0's last dicts of call ``call_id``, once that call has returned.

    Rank 0 has queued all it will log for the call by then: the poll in flight answers
    at once, with dicts it may already hold, and one more without waiting takes any that
    came after it. That one comes before the first's dicts are delivered, which would
    tell a poster waiting for them that they were (see LogChannel): none waits, since
    the call has returned.
    """
    items, finished = ray.get(poll)
    if not finished:
        items = [*items, *ray.get(rank0.next_logs.remote(call_id, 0))[0]]
    return items
