"""Where a job is in its life: the states, the moves allowed between them, one writer.

:class:`Lifecycle` holds any such table: the executor's (:class:`ExecutorState`) and an
elastic run's (:class:`RunState`, in ``elastic_run.ElasticRun``). :class:`CallGate`
admits the executor's calls while it runs, counts those in flight, ends the job when
one fails, and makes stop()'s moves.
"""

from __future__ import annotations

import enum
import functools
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, NoReturn, TypeVar, cast

from horovod_ray.errors import ExecutorStateError, StartCancelledError, interrupt_in, start_error

if TYPE_CHECKING:
    from horovod_ray.job.kinds import HeldJob, JobKind

logger = logging.getLogger(__name__)

T = TypeVar("T")


class ExecutorState(enum.Enum):
    """Where a RayExecutor is in its life.

    Allowed transitions (``TRANSITIONS``)::

        CREATED  -> STARTING -> RUNNING -> STOPPING -> STOPPED
        CREATED  -> STOPPED                 (stop() before start())
        STARTING -> FAILED                  (start failed; everything taken was released)
        STARTING -> STOPPED                 (stop() during start(): start() gave up and
                                             released everything)
        STOPPING -> FAILED                  (a rank failed, or a call was aborted by
                                             Ctrl-C or a raising callback; the job was
                                             stopped on the way)
        STOPPING -> STARTING                (a call's ranks failed, the job was stopped,
                                             and ``max_restarts`` starts a new one)

    STOPPED and FAILED are final: a new job needs a new RayExecutor.
    """

    CREATED = "created"
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"


_S = ExecutorState
TRANSITIONS: dict[ExecutorState, frozenset[ExecutorState]] = {
    _S.CREATED: frozenset({_S.STARTING, _S.STOPPED}),
    _S.STARTING: frozenset({_S.RUNNING, _S.FAILED, _S.STOPPED}),
    _S.RUNNING: frozenset({_S.STOPPING}),
    _S.STOPPING: frozenset({_S.STOPPED, _S.FAILED, _S.STARTING}),
    _S.STOPPED: frozenset(),
    _S.FAILED: frozenset(),
}
FINAL = frozenset({_S.STOPPED, _S.FAILED})
# Longest stop() waits for a cancelled start() to release what it took.
STOP_CANCEL_S = 30.0
# Longest stop() waits for another thread's stop (or a failed call's release) to end.
STOP_WAIT_S = 60.0


class RunState(enum.Enum):
    """Where an elastic run is.

    Allowed transitions (``RUN_TRANSITIONS``), in ``elastic_run.ElasticRun``::

        CREATED -> RUNNING -> STOPPING -> ENDED
        CREATED -> STOPPING                 (stop() before the run began)

    The run's own thread moves RUNNING -> STOPPING when the driver finished, stop() does
    from any thread; only the run's thread moves STOPPING -> ENDED, once all is released.
    """

    CREATED = "created"
    RUNNING = "running"
    STOPPING = "stopping"
    ENDED = "ended"


_R = RunState
RUN_TRANSITIONS = {
    _R.CREATED: frozenset({_R.RUNNING, _R.STOPPING}),
    _R.RUNNING: frozenset({_R.STOPPING}),
    _R.STOPPING: frozenset({_R.ENDED}),
    _R.ENDED: frozenset(),
}


class Lifecycle:
    """A state and its table of moves; :meth:`transition` is the only place it changes.

    Args:
        transitions: State -> the states it may move to (the executor's by default).
        initial: The first state.
        on_change: Called with each new state, in the moving thread, as it moves.
    """

    def __init__(
        self,
        transitions: Mapping[enum.Enum, frozenset] = TRANSITIONS,
        initial: enum.Enum = ExecutorState.CREATED,
        on_change: Callable[[Any], None] | None = None,
    ) -> None:
        self._transitions = transitions
        self._state = initial
        self._changed = threading.Condition()
        self._on_change = on_change

    @property
    def state(self) -> Any:
        return self._state

    def is_in(self, *states: enum.Enum) -> bool:
        """Whether the state is one of ``states``."""
        return self._state in states

    def transition(self, allowed_from: Iterable[enum.Enum], to: enum.Enum) -> bool:
        """Moves to ``to`` if the state is one of ``allowed_from``; says whether it moved.

        Raises:
            RuntimeError: ``TRANSITIONS`` has no such move (a bug in the caller).
        """
        with self._changed:
            current = self._state
            if current not in set(allowed_from):
                return False
            if to not in self._transitions[current]:
                raise RuntimeError(f"no transition {current.value} -> {to.value}")
            self._state = to
            if self._on_change is not None:
                self._on_change(to)  # under the lock: the states are told in order
            self._changed.notify_all()
            return True

    def wait_for(self, states: Iterable[enum.Enum], timeout_s: float) -> bool:
        """Waits until the state is one of ``states``; False if ``timeout_s`` passed first."""
        wanted = set(states)
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while self._state not in wanted:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
            return True

    def finish_start(self, release: Callable[[], None], cancelled: bool) -> None:
        """After a failed start: ``release()``, then STARTING -> FAILED (STOPPED when
        stop() cancelled the start), whatever it raised."""
        try:
            release()
        finally:
            final = ExecutorState.STOPPED if cancelled else ExecutorState.FAILED
            self.transition([ExecutorState.STARTING], final)

    def fail_start(
        self, err: BaseException, release: Callable[[], None], cancelled: bool
    ) -> NoReturn:
        """:meth:`finish_start`, then raises what the caller of start() sees
        (``errors.start_error``): ``err`` itself, a ``KeyboardInterrupt``, or the error
        it became, from ``err``."""
        self.finish_start(release, cancelled)
        error = start_error(err, cancelled)
        if isinstance(error, KeyboardInterrupt):
            raise error from None
        if error is err:
            raise err  # the error start() met, as it was
        raise error from err

    def end(self, release: Callable[[], None], final: ExecutorState) -> None:
        """From STOPPING (the caller moved there, under its own lock): ``release()``, then
        ``final`` (STOPPED or FAILED; STARTING for a restart) whatever it raised, save that a
        release that raised ends a restart FAILED: nothing would start again."""
        released = False
        try:
            release()
            released = True
        finally:
            if final is ExecutorState.STARTING and not released:
                final = ExecutorState.FAILED
            self.transition([ExecutorState.STOPPING], final)


class CallGate:
    """Admits calls to a RUNNING job and counts those in flight, under one lock with the
    moves out of RUNNING, so that a stop() never takes a job with a call under way for
    idle, and no call begins once the job left RUNNING.

    Args:
        lifecycle: The executor's lifecycle.
        kind: The executor's job (``kinds.JobKind``), for :meth:`job`; None where only
            :meth:`admit` is used.
    """

    def __init__(self, lifecycle: Lifecycle, kind: JobKind | None = None) -> None:
        self._lifecycle = lifecycle
        self._kind = kind
        self._lock = threading.RLock()
        self._in_flight = 0

    def admit(self, admit: Callable[[], None] | None, counted: bool) -> ExecutorState:
        """If the job is RUNNING: runs ``admit()`` (when given) and, with ``counted``,
        counts one more call in flight until :meth:`done`. Returns the state it found
        (the call was admitted if RUNNING), for the error that refuses the call."""
        with self._lock:
            state = self._lifecycle.state
            if state is ExecutorState.RUNNING:
                if admit is not None:
                    admit()
                if counted:
                    self._in_flight += 1
            return state

    def job(self, action: str, call: Any = None, counted: bool = False) -> JobKind:
        """The executor's job (``kind``), if it can take ``action`` now: the kind does
        not refuse it and the job is RUNNING (a ``call`` is then admitted, and with
        ``counted`` it is in flight until :meth:`done`).

        Raises:
            ExecutorStateError: The kind refuses ``action``, or the job is not running.
        """
        with self._lock:  # the kind a restart put in place, or the one before: not a mix
            kind = self._kind
            kind.refuse(action, call)
            state = self.admit(kind.admit if call is not None else None, counted)
        if state is ExecutorState.RUNNING:
            return kind
        raise ExecutorStateError(f"{action} needs a running executor, {state_hint(state)}")

    def held(self, action: str, call: Any = None) -> HeldJob:
        """:meth:`job`, for what only a kind that holds its ranks does: the kind's
        ``refuse`` has kept ``action`` off any other."""
        return cast("HeldJob", self.job(action, call))

    def replace(self, kind: JobKind) -> None:
        """A restart's new job takes the place of the failed one (no call is in flight:
        the job is STARTING)."""
        with self._lock:
            self._kind = kind

    def done(self) -> None:
        """A counted call ended."""
        with self._lock:
            self._in_flight -= 1

    def run(
        self,
        action: str,
        body: Callable[[Callable[[], bool]], T],
        release: Callable[[], None],
        restarts: Callable[[BaseException], bool] = lambda err: False,
        kind: JobKind | None = None,
    ) -> T:
        """Runs ``body(failing)`` for a call :meth:`admit` counted, until :meth:`done`;
        on any failure (a rank's, Ctrl-C, a raising callback: the ranks cannot be left half
        done) moves the job to STOPPING, ends it FAILED after ``release()`` (STARTING if
        ``restarts(err)``: the caller starts a new job), and re-raises.

        The call counts as in flight from the moment it was admitted, so that a stop()
        can never take it for idle. ``body`` calls ``failing()`` as soon as it knows the
        call failed, before it looks at the ranks or releases anything: it says whether
        the failure is this call's (the job moved to STOPPING), not a stop() or another
        call's failure already under way, nor that of a job a restart has replaced since
        (``kind``: the job the call was admitted to).

        Raises:
            ExecutorStateError: The job was stopped (by stop(), or another call's failure)
                while this call ran.
        """
        moved = False

        def failing() -> bool:
            nonlocal moved
            moved = moved or self.fail(kind)
            return moved

        try:
            return body(failing)
        except BaseException as err:
            failing()
            if moved:
                after = ExecutorState.STARTING if restarts(err) else ExecutorState.FAILED
                self._lifecycle.end(release, after)
            interrupt = interrupt_in(err)
            if interrupt is not None:
                raise interrupt from None
            if not moved and not isinstance(err, ExecutorStateError):
                first_line = str(err).splitlines()[0] if str(err) else ""
                raise ExecutorStateError(
                    f"{action} was ended because the job was stopped while it ran (by stop() "
                    f"or another call's failure): {type(err).__name__}: {first_line}"
                ) from err
            raise
        finally:
            self.done()

    def fail(self, kind: JobKind | None = None) -> bool:
        """A call failed: RUNNING -> STOPPING; says whether this moved it (not a stop()
        or another call's failure already under way, nor a call to a job ``kind`` that a
        restart has replaced)."""
        with self._lock:
            if kind is not None and kind is not self._kind:
                return False
            return self._lifecycle.transition([ExecutorState.RUNNING], ExecutorState.STOPPING)

    def close(self) -> tuple[bool, bool]:
        """stop(): RUNNING -> STOPPING. Returns (whether calls were in flight, whether this
        moved it)."""
        with self._lock:
            busy = self._in_flight > 0
            return busy, self._lifecycle.transition([ExecutorState.RUNNING], ExecutorState.STOPPING)

    def stop(self, cancel: Cancel, release: Callable[[bool], None]) -> None:
        """``RayExecutor.stop()``'s moves: from CREATED, STOPPED at once; from STARTING,
        cancels the start and waits (up to ``STOP_CANCEL_S``) for it to give up or
        finish; from RUNNING, STOPPING, then ``release(busy)`` (whether calls were in
        flight: they are aborted), then STOPPED. Where another thread is stopping the
        job, waits up to ``STOP_WAIT_S`` for it to end; where that was a failed call whose
        job restarts, cancels the restart as a start."""
        lifecycle = self._lifecycle
        if lifecycle.transition([ExecutorState.CREATED], ExecutorState.STOPPED):
            return
        while True:
            if lifecycle.state is ExecutorState.STARTING:
                cancel.set()
                if not lifecycle.wait_for(FINAL | {ExecutorState.RUNNING}, STOP_CANCEL_S):
                    logger.warning("start() did not give up within %gs of stop()", STOP_CANCEL_S)
                    return
            busy, moved = self.close()  # no call begins once this moved
            if moved:
                lifecycle.end(functools.partial(release, busy), ExecutorState.STOPPED)
                return
            # Another thread is stopping it (a stop(), a failed call): released once it
            # ends, or once it moved on to restart (STARTING: cancelled above).
            if not lifecycle.wait_for(FINAL | {ExecutorState.STARTING}, STOP_WAIT_S):
                logger.warning("the job was not released within %gs of stop()", STOP_WAIT_S)
                return
            if lifecycle.state in FINAL:
                return


def state_hint(state: ExecutorState) -> str:
    """What to do about a call in ``state``, for the error that refuses it."""
    if state is ExecutorState.CREATED:
        hint = "call start() first (or use `with RayExecutor(...) as executor:`)"
    elif state is ExecutorState.STARTING:
        hint = (
            "its job is starting (or starting again after a failure: max_restarts); call "
            "again once it runs"
        )
    elif state is ExecutorState.FAILED:
        hint = "the job failed and was stopped; create a new RayExecutor"
    else:
        hint = "the job was stopped; create a new RayExecutor"
    return f"this one is {state.value}: {hint}"


class Cancel(threading.Event):
    """Set by stop() while start() runs; the start's waits call :meth:`check`."""

    def check(self) -> None:
        """Raises StartCancelledError once set: the start gives up where it is."""
        if self.is_set():
            raise StartCancelledError()
