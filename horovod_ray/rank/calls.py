"""How a function call travels from the driver to the ranks: both halves of the protocol.

Measured on this project's machines (docs/benchmarks.rst, "Fixes found by measuring"), a
call to every rank costs mostly in what each actor call carries. So:

* Functions and arguments are pickled once, on the driver, where an unpicklable one is a
  ``ConfigError`` naming it; payloads over ``PUT_ABOVE_BYTES`` go to the object store
  once for all ranks instead of once per rank.
* A function sent before travels as a small integer key; the ranks keep its pickled
  bytes (:class:`Dispatcher` decides, :class:`RankCalls` keeps). The cache is bounded by
  count and by bytes, on the driver and so on every rank. A key travels alone only once a
  call that carried its bytes has returned on every rank: a call made meanwhile, from
  another thread, carries them again, so no rank is ever sent a key it has not learned.
* A call that repeats the call just before it (same function, same arguments, completed
  on every rank, nothing in between) goes with its call id alone: each rank runs that
  call again, by its id, as the next call id. When no other call is in flight either, it
  goes with no argument at all (each argument costs the driver tens of microseconds per
  rank): every earlier call has then run on every rank, so a rank numbers it as one past
  the latest call it ran, unless a later call overtook it on its way. A call sent while a
  repeat is in flight names the repeat's id: a rank it reaches first keeps the repeated
  call however many bytes come after it, and keeps a bare repeat's id for it.
* Every call, repeats included, runs a fresh copy of the function, unpickled from its
  bytes: what a closure, a mutable default or a callable object changed during one call
  is not seen by the next, as with horovod.ray. An ``executable_cls`` instance is made
  once, at setup, and keeps its state between calls.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable, Mapping, Sequence

import cloudpickle
import ray

from horovod_ray.errors import ConfigError

# Distinct functions each job keeps unpickled on its ranks, and their pickled bytes.
FN_CACHE_SIZE = 256
FN_CACHE_BYTES = 64 << 20
# A payload larger than this goes to the object store once rather than once per rank.
PUT_ABOVE_BYTES = 100 << 10
# Recent calls a rank keeps for a repeat (by count, and by the bytes of their payloads):
# a repeat names the call it repeats, which calls from other threads may have followed.
RECENT_CALLS = 64
RECENT_BYTES = 64 << 20


# ----------------------------------------------------------------------- checking input


def pickle_fn(name: str, fn: object) -> bytes:
    """``fn`` pickled; ConfigError naming ``name`` if it is not callable or not picklable."""
    if not callable(fn):
        raise ConfigError(name, f"{name} must be callable, got {type(fn).__name__} {fn!r}")
    return pickle_value(name, fn)


def pickle_value(name: str, value: object) -> bytes:
    """``value`` pickled as it will travel; ConfigError naming ``name`` if it cannot be."""
    try:
        return cloudpickle.dumps(value)
    except Exception as err:
        raise ConfigError(
            name, f"{name} cannot be pickled to send to the workers: {type(err).__name__}: {err}"
        ) from err


def as_tuple(name: str, value: Sequence[Any] | None) -> tuple:
    if value is None:
        return ()
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise ConfigError(name, f"{name} must be a list or tuple, got {type(value).__name__}")
    return tuple(value)


def as_kwargs(name: str, value: Mapping[str, Any] | None) -> dict:
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ConfigError(name, f"{name} must be a dict with str keys, got {value!r}")
    return dict(value)


def check_callbacks(callbacks: object) -> list[Callable[[dict], None]]:
    if callbacks is None:
        return []
    if callable(callbacks):
        return [callbacks]
    if not isinstance(callbacks, (list, tuple)) or not all(callable(c) for c in callbacks):
        raise ConfigError(
            "callbacks",
            f"callbacks must be a list of callables (functions, horovod_ray.Callback "
            f"objects), got {callbacks!r}",
        )
    return list(callbacks)


@dataclasses.dataclass(frozen=True)
class Call:
    """A call checked and pickled once: ``fn(*args, **kwargs)``, or ``fn(executable)``.

    ``args`` is None for an ``execute`` (the rank passes its ``executable_cls`` instance).
    """

    fn: bytes
    args: bytes | None


def prepare(
    fn: object,
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    fn_name: str = "fn",
) -> Call:
    """Checks and pickles a ``run`` call.

    Raises:
        ConfigError: Naming ``fn_name``, ``args`` or ``kwargs``.
    """
    payload = pickle_fn(fn_name, fn)
    arguments = pickle_value("args", (as_tuple("args", args), as_kwargs("kwargs", kwargs)))
    return Call(payload, arguments)


def prepare_execute(fn: object) -> Call:
    """Checks and pickles an ``execute`` call."""
    return Call(pickle_fn("fn", fn), None)


# --------------------------------------------------------------------- the driver's half


@dataclasses.dataclass(frozen=True)
class Message:
    """What one call sends to each rank: ``again``, or the full arguments of ``call``."""

    call_id: int
    again: bool
    key: int | None  # the function's cache key, None when it goes uncached
    fn: bytes | ray.ObjectRef | None  # None when the rank has the key already
    args: bytes | ray.ObjectRef | None
    bare: bool = False  # a repeat sent with no argument (the rank numbers it)
    all_ranks: bool = True
    # (id, whether it went bare) of a repeat that may still be on its way
    repeat_in_flight: tuple[int, bool] | None = None


class Dispatcher:
    """Numbers a job's calls and decides what each one sends.

    Thread-safe. The ranks mirror its decisions (see :class:`RankCalls`), so every call
    must go through :meth:`send`, and only calls that completed on every rank may be
    reported to :meth:`completed`.
    """

    def __init__(self, cache_size: int = FN_CACHE_SIZE, cache_bytes: int = FN_CACHE_BYTES):
        self._lock = threading.Lock()
        self._cache_size = cache_size
        self._cache_bytes = cache_bytes
        self._keys: dict[bytes, int] = {}
        # Keys whose bytes every rank holds: a call that carried them returned everywhere.
        self._known: set[int] = set()
        self._cached_bytes = 0
        self._call_id = 0
        # (function payload, args payload, call id) of the last call done on every rank.
        self._last: tuple[bytes, bytes | None, int] | None = None
        # Calls sent and not reported completed. One that failed, or a run_remote's (whose
        # end the driver does not see), stays counted: later repeats then carry their
        # ids, which is always safe.
        self._in_flight = 0
        # The id of the latest repeat not yet completed, and whether it went bare.
        self._repeat: tuple[int, bool] | None = None

    def send(
        self, call: Call, workers: Sequence[Any], all_ranks: bool = True, as_raised: bool = False
    ) -> tuple[Message, list[ray.ObjectRef]]:
        """Numbers ``call``, decides what it sends and starts it on ``workers``, in one
        step under the lock: every rank is then sent the calls in the order of their ids
        (Ray may still run them in another order, see :class:`RankCalls`).

        Args:
            call: The prepared call.
            workers: The ranks' actors (none: only the decision, as the tests use it).
            all_ranks: False for a call to rank 0 only: it neither uses nor fills the
                function cache, ends any repeat, and sends its payloads as they are (one
                recipient: nothing to share through the object store).
            as_raised: See :func:`send`.

        Returns:
            The message, and one ref per worker (see :func:`send`).
        """
        with self._lock:
            message = self._next(call, all_ranks, as_raised)
            self._in_flight += 1
            if message.again:
                self._repeat = (message.call_id, message.bare)
            return message, [send(worker, message, as_raised) for worker in workers]

    def _next(self, call: Call, all_ranks: bool, as_raised: bool) -> Message:
        self._call_id += 1
        call_id = self._call_id
        message = self._decide(call, call_id, all_ranks, as_raised)
        if self._repeat is not None and not message.again:
            return dataclasses.replace(message, repeat_in_flight=self._repeat)
        return message

    def _decide(self, call: Call, call_id: int, all_ranks: bool, as_raised: bool) -> Message:
        if not all_ranks:
            return Message(call_id, False, None, call.fn, call.args, all_ranks=False)
        if self._last == (call.fn, call.args, call_id - 1):
            bare = self._in_flight == 0 and not as_raised
            return Message(call_id, True, None, None, None, bare=bare)
        key = self._keys.get(call.fn)
        if key in self._known:
            return Message(call_id, False, key, None, _stored(call.args))
        if key is not None:  # sent before, not yet returned everywhere: send it again
            return Message(call_id, False, key, _stored(call.fn), _stored(call.args))
        fits = self._cached_bytes + len(call.fn) <= self._cache_bytes
        if len(self._keys) >= self._cache_size or not fits:
            return Message(call_id, False, None, _stored(call.fn), _stored(call.args))
        key = self._keys[call.fn] = len(self._keys) + 1
        self._cached_bytes += len(call.fn)
        return Message(call_id, False, key, _stored(call.fn), _stored(call.args))

    def completed(self, call: Call, message: Message) -> None:
        """Records that ``message`` returned on every rank it was sent to: the next call
        may repeat it, and the function's key may travel alone from now on."""
        with self._lock:
            self._in_flight -= 1
            if self._repeat is not None and self._repeat[0] == message.call_id:
                self._repeat = None
            if not message.all_ranks:
                return
            self._last = (call.fn, call.args, message.call_id)
            if message.key is not None and message.fn is not None:
                self._known.add(message.key)


def _stored(payload: bytes | None) -> bytes | ray.ObjectRef | None:
    # Ray passes a top-level ObjectRef argument to the actor as its value.
    if payload is not None and len(payload) > PUT_ABOVE_BYTES:
        return ray.put(payload)
    return payload


def send(worker: Any, message: Message, as_raised: bool = False) -> ray.ObjectRef:
    """Starts ``message`` on one rank's actor; with ``as_raised``, its ref holds what the
    function raised as it was raised, not as a ``RankError`` (see Worker.call)."""
    # Each argument costs the driver tens of microseconds per rank: as_raised goes only
    # when it is True.
    raised = (True,) if as_raised else ()
    if message.bare:
        return worker.again_next.remote()
    if message.again:
        return worker.again.remote(message.call_id, *raised)
    call_id = message.call_id
    if message.repeat_in_flight is not None:
        call_id = (call_id, *message.repeat_in_flight)
    return worker.call.remote(call_id, message.key, message.fn, message.args, *raised)


# ---------------------------------------------------------------------- the ranks' half


class RankCalls:
    """A rank's half: the pickled functions it keeps, and its recent calls, to run again.

    Functions are kept as bytes and unpickled for every call, so that no call sees what
    an earlier one did to the function's own state. Recent calls are kept by id, not as
    "the last one": calls from several of the driver's threads may reach a rank in
    another order than their ids, so a repeat of call N-1 may arrive after call N+2.
    """

    def __init__(self) -> None:
        self._functions: dict[int, bytes] = {}
        # call id -> (function bytes, args payload), oldest first; bounded below.
        self._recent: dict[int, tuple[bytes, bytes | None]] = {}
        self._recent_bytes = 0
        # Ids of repeats that later calls overtook: sent, not yet run here; bare ones
        # (numbered by next_repeat_id) and the others. The calls they repeat are kept
        # whatever their bytes (see _remember).
        self._overtaken: set[int] = set()
        self._pinned: set[int] = set()

    def overtook(self, call_id: int, bare: bool) -> None:
        """Notes that a call sent after repeat ``call_id`` arrived here, if that repeat has
        not run here yet.

        A bare repeat went when every earlier call had run everywhere, so no call older
        than it can come after it: one not kept and newer than every kept call has not
        run. A repeat with its id may have calls older than it still on their way, so
        that does not hold; but the call it repeats ran here before it was sent, and
        calls leave oldest first: while that call is kept, the repeat is kept once run.
        """
        if call_id in self._recent:
            return
        if bare:
            if call_id > min(self._recent, default=0):
                self._overtaken.add(call_id)
        elif call_id - 1 in self._recent:
            self._pinned.add(call_id)

    def next_repeat_id(self) -> int:
        """The id of a bare repeat that has just arrived (see calls.Dispatcher): when it
        was sent, every earlier call had run here, and calls sent after it name it."""
        if self._overtaken:
            call_id = min(self._overtaken)
            self._overtaken.discard(call_id)
            return call_id
        # The highest id run here: calls leave oldest first, and never the last one.
        return max(self._recent, default=0) + 1

    def resolve(
        self, call_id: int, key: int | None, fn: bytes | None, args: bytes | None
    ) -> tuple[Callable[..., Any], bytes | None]:
        """A fresh copy of the call's function and its args payload; the function's bytes
        are kept under ``key``."""
        if fn is None:
            fn = self._functions[key]
        elif key is not None:
            self._functions[key] = fn
        self._remember(call_id, fn, args)
        return cloudpickle.loads(fn), args

    def repeat(self, call_id: int) -> tuple[Callable[..., Any], bytes | None]:
        """A fresh copy of call ``call_id - 1``'s function and its args, for ``call_id``.

        Raises:
            RuntimeError: This rank no longer holds call ``call_id - 1`` (more than
                ``RECENT_CALLS`` calls came in between: that many in flight at once).
        """
        self._overtaken.discard(call_id)
        self._pinned.discard(call_id)
        repeated = self._recent.get(call_id - 1)
        if repeated is None:
            raise RuntimeError(
                f"call {call_id} repeats call {call_id - 1}, which this rank no longer holds "
                f"(it keeps its last {RECENT_CALLS} calls)"
            )
        self._remember(call_id, *repeated)
        fn, args = repeated
        return cloudpickle.loads(fn), args

    def _remember(self, call_id: int, fn: bytes, args: bytes | None) -> None:
        self._recent[call_id] = (fn, args)
        self._recent_bytes += len(fn) + len(args or b"")
        # Oldest first; past the bytes, not a call that a repeat still on its way needs:
        # a call from another thread larger than RECENT_BYTES, overtaking that repeat,
        # once made it fail.
        while True:
            oldest = min(self._recent)
            needed = oldest + 1 in self._overtaken or oldest + 1 in self._pinned
            over_bytes = self._recent_bytes > RECENT_BYTES and len(self._recent) > 1
            if not (len(self._recent) > RECENT_CALLS or (over_bytes and not needed)):
                break
            fn, args = self._recent.pop(oldest)
            self._recent_bytes -= len(fn) + len(args or b"")


def invoke(function: Callable[..., Any], args: bytes | None, executable: Any) -> Any:
    """Calls ``function`` as ``execute`` (with ``executable``) or as ``run`` (with args)."""
    if args is None:
        return function(executable)
    positional, keywords = cloudpickle.loads(args)  # fresh objects for every call
    return function(*positional, **keywords)
