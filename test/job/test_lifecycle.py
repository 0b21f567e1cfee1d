"""The executor's state table and its one writer, without Ray."""

from __future__ import annotations

import itertools
import threading

import pytest

from horovod_ray.errors import ExecutorStateError
from horovod_ray.job.lifecycle import FINAL, TRANSITIONS, CallGate, ExecutorState, Lifecycle

pytestmark = pytest.mark.unit  # pure logic: no Ray (make test runs these first)

S = ExecutorState
# Every path a job can take, as the executor's docstring lists them.
PATHS = [
    [S.CREATED, S.STARTING, S.RUNNING, S.STOPPING, S.STOPPED],  # start, stop
    [S.CREATED, S.STOPPED],  # stop() before start()
    [S.CREATED, S.STARTING, S.FAILED],  # start failed
    [S.CREATED, S.STARTING, S.STOPPED],  # stop() during start()
    [S.CREATED, S.STARTING, S.RUNNING, S.STOPPING, S.FAILED],  # a call failed
    [S.CREATED, S.STARTING, S.RUNNING, S.STOPPING, S.STARTING],  # ... and max_restarts
]


def _walk(path: list[ExecutorState]) -> Lifecycle:
    lifecycle = Lifecycle()
    for before, after in itertools.pairwise(path):
        assert lifecycle.transition([before], after)
    return lifecycle


@pytest.mark.parametrize("path", PATHS, ids=lambda p: "-".join(s.value for s in p))
def test_every_documented_path_is_allowed(path):
    assert _walk(path).state is path[-1]


def test_the_table_holds_exactly_the_documented_moves():
    documented = {pair for path in PATHS for pair in itertools.pairwise(path)}
    table = {(a, b) for a, targets in TRANSITIONS.items() for b in targets}
    assert table == documented
    assert all(not TRANSITIONS[state] for state in FINAL)


def test_a_move_from_another_state_does_not_happen():
    lifecycle = _walk([S.CREATED, S.STOPPED])
    assert not lifecycle.transition([S.CREATED], S.STARTING)
    assert lifecycle.state is S.STOPPED


@pytest.mark.parametrize(
    "before, after", [(S.RUNNING, S.FAILED), (S.CREATED, S.RUNNING), (S.STOPPING, S.RUNNING)]
)
def test_a_move_the_table_lacks_is_a_bug(before, after):
    path = {S.RUNNING: PATHS[0][:3], S.CREATED: [S.CREATED], S.STOPPING: PATHS[0][:4]}[before]
    lifecycle = _walk(path)
    with pytest.raises(RuntimeError, match="no transition"):
        lifecycle.transition([before], after)
    assert lifecycle.state is before


def test_wait_for_wakes_on_the_move_and_times_out_without_one():
    lifecycle = _walk([S.CREATED, S.STARTING])
    assert not lifecycle.wait_for(FINAL, timeout_s=0.05)
    mover = threading.Timer(0.05, lifecycle.transition, args=([S.STARTING], S.STOPPED))
    mover.start()
    assert lifecycle.wait_for(FINAL, timeout_s=10)
    mover.join()


def test_an_elastic_runs_states_end_once_everything_is_released():
    from horovod_ray.job.lifecycle import RUN_TRANSITIONS, RunState

    run = Lifecycle(RUN_TRANSITIONS, RunState.CREATED)
    assert run.transition([RunState.CREATED], RunState.RUNNING)
    # stop() from another thread and the run's own end both try RUNNING -> STOPPING: once.
    assert run.transition([RunState.CREATED, RunState.RUNNING], RunState.STOPPING)
    assert not run.transition([RunState.RUNNING], RunState.STOPPING)
    assert not run.wait_for({RunState.ENDED}, timeout_s=0.05)
    assert run.transition([RunState.STOPPING], RunState.ENDED)
    with pytest.raises(RuntimeError, match="no transition"):
        run.transition([RunState.ENDED], RunState.RUNNING)


@pytest.mark.parametrize("final", [S.STOPPED, S.FAILED])
def test_end_reaches_its_final_state_even_when_the_release_raises(final):
    lifecycle = _walk(PATHS[0][:4])  # at STOPPING

    def release():
        raise RuntimeError("kill failed")

    with pytest.raises(RuntimeError, match="kill failed"):
        lifecycle.end(release, final)
    assert lifecycle.state is final


@pytest.mark.parametrize("cancelled, final", [(False, S.FAILED), (True, S.STOPPED)])
def test_a_failed_start_ends_failed_or_stopped_when_cancelled(cancelled, final):
    lifecycle = _walk([S.CREATED, S.STARTING])
    released = []
    lifecycle.finish_start(lambda: released.append(True), cancelled)
    assert released == [True] and lifecycle.state is final


def test_the_call_gate_admits_only_while_running_and_counts_calls_until_done():
    lifecycle = _walk([S.CREATED, S.STARTING])
    gate = CallGate(lifecycle)
    admitted = []
    assert gate.admit(lambda: admitted.append("early"), counted=True) is S.STARTING
    lifecycle.transition([S.STARTING], S.RUNNING)
    assert gate.admit(lambda: admitted.append("call"), counted=True) is S.RUNNING
    assert gate.admit(None, counted=False) is S.RUNNING  # a property read: not in flight
    assert admitted == ["call"]
    assert gate.close() == (True, True)  # a call was in flight; this stop moved it
    assert gate.admit(lambda: admitted.append("late"), counted=True) is S.STOPPING
    assert admitted == ["call"] and lifecycle.state is S.STOPPING


def test_the_call_gate_lets_the_first_failure_or_stop_move_the_job_and_no_other():
    lifecycle = _walk([S.CREATED, S.STARTING, S.RUNNING])
    gate = CallGate(lifecycle)
    assert gate.admit(None, counted=True) is S.RUNNING
    gate.done()
    assert gate.fail() is True  # this call's failure stops the job
    assert gate.fail() is False  # another's comes after it
    assert gate.close() == (False, False)  # nothing in flight, and stop() found it moved


def _running_gate() -> tuple[Lifecycle, CallGate]:
    lifecycle = _walk([S.CREATED, S.STARTING, S.RUNNING])
    gate = CallGate(lifecycle)
    assert gate.admit(None, counted=True) is S.RUNNING
    return lifecycle, gate


def test_a_call_that_fails_ends_the_job_failed_after_its_release_and_reraises():
    lifecycle, gate = _running_gate()
    released, told = [], []

    def body(failing):
        told.append(failing())  # the call says it failed as soon as it knows
        raise ValueError("rank 1 raised")

    with pytest.raises(ValueError, match="rank 1 raised"):
        gate.run("run", body, lambda: released.append(lifecycle.state))
    assert told == [True] and released == [S.STOPPING] and lifecycle.state is S.FAILED
    assert gate.close() == (False, False)  # no longer in flight


def test_a_call_ended_by_a_stop_says_so_and_does_not_release_again():
    lifecycle, gate = _running_gate()
    released = []

    def body(failing):
        assert gate.close() == (True, True)  # stop() from another thread, mid-call
        raise RuntimeError("Horovod has been shut down\nmore")

    with pytest.raises(ExecutorStateError, match=r"run was ended because the job was stopped"):
        gate.run("run", body, lambda: released.append(True))
    assert released == [] and lifecycle.state is S.STOPPING  # stop() releases, not the call


def test_a_call_returns_its_result_and_leaves_the_job_running():
    lifecycle, gate = _running_gate()
    assert gate.run("run", lambda failing: [1, 2], lambda: None) == [1, 2]
    assert lifecycle.state is S.RUNNING and gate.close() == (False, True)


def test_a_restart_whose_release_raised_ends_failed_not_starting():
    """Nothing would start the job again: a later stop() would wait for a start."""
    lifecycle, gate = _running_gate()

    def release():
        raise RuntimeError("kill failed")

    with pytest.raises(RuntimeError, match="kill failed"):
        gate.run("run", _raises(RankFailedError()), release, lambda err: True)
    assert lifecycle.state is S.FAILED


def test_a_call_to_a_job_a_restart_replaced_moves_nothing():
    """A call admitted to the failed job fails after the restart's job runs: the new job
    is not stopped for it."""

    class Kind:
        pass

    old, new = Kind(), Kind()
    lifecycle = _walk([S.CREATED, S.STARTING, S.RUNNING])
    gate = CallGate(lifecycle, old)
    assert gate.fail(old) is True  # the first failure: STOPPING, then the restart
    lifecycle.end(lambda: None, S.STARTING)
    gate.replace(new)
    lifecycle.transition([S.STARTING], S.RUNNING)
    assert gate.fail(old) is False and lifecycle.state is S.RUNNING
    assert gate.fail(new) is True


class RankFailedError(Exception):
    pass


def _raises(error):
    def body(failing):
        failing()
        raise error

    return body
