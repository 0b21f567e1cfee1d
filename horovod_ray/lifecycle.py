"""Where a job is in its life: the states, the moves allowed between them, one writer."""

from __future__ import annotations

import enum
import threading
import time
from typing import Iterable


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
    _S.STOPPING: frozenset({_S.STOPPED, _S.FAILED}),
    _S.STOPPED: frozenset(),
    _S.FAILED: frozenset(),
}
FINAL = frozenset({_S.STOPPED, _S.FAILED})


class Lifecycle:
    """A job's state; :meth:`transition` is the only place it changes."""

    def __init__(self) -> None:
        self._state = ExecutorState.CREATED
        self._changed = threading.Condition()

    @property
    def state(self) -> ExecutorState:
        return self._state

    def transition(self, allowed_from: Iterable[ExecutorState], to: ExecutorState) -> bool:
        """Moves to ``to`` if the state is one of ``allowed_from``; says whether it moved.

        Raises:
            RuntimeError: ``TRANSITIONS`` has no such move (a bug in the caller).
        """
        with self._changed:
            current = self._state
            if current not in set(allowed_from):
                return False
            if to not in TRANSITIONS[current]:
                raise RuntimeError(f"no transition {current.value} -> {to.value}")
            self._state = to
            self._changed.notify_all()
            return True

    def wait_for(self, states: Iterable[ExecutorState], timeout_s: float) -> bool:
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
