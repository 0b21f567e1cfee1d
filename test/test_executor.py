"""RayExecutor on a real local Ray with real Horovod collectives (horovod.torch)."""

from __future__ import annotations

import logging
import os
import re
import threading
import time

import pytest
import ray

from horovod_ray import (
    ConfigError,
    ExecutorState,
    ExecutorStateError,
    HorovodRayError,
    RayExecutor,
    StartCancelledError,
    WorkerFailedError,
    log,
)
from test.conftest import (
    alive_actors,
    live_placement_groups,
    run_fresh_python,
    start_local_ray,
    wait_until,
)
from test.horovod_identity import horovod_identity as identity

pytestmark = pytest.mark.timeout(180)

SETTINGS = RayExecutor.create_settings(timeout_s=60, placement_group_timeout_s=30)


def horovod_identity():
    """What Horovod says about this rank (after one allreduce), its node, its env."""
    return {
        **identity(),
        "node_id": ray.get_runtime_context().get_node_id(),
        "env": {k: v for k, v in os.environ.items() if k.startswith("HOROVOD_")},
    }


SLEEP_LINE = "time.sleep(0.05)  # the line stacks() shows"


def _waits_for(path: str) -> str:
    while not os.path.exists(path):
        time.sleep(0.05)  # the line stacks() shows
    return "went on"


@pytest.fixture(scope="class")
def executor():
    """One running 3-rank job shared by the read-only tests of this module."""
    start_local_ray(4)
    with RayExecutor(SETTINGS, num_workers=3) as executor:
        yield executor


class TestRunningJob:
    """Read-only calls on one running 3-rank job."""

    def test_ranks_env_and_allreduce_on_one_node(self, executor):
        results = executor.run(horovod_identity)
        assert [r["rank"] for r in results] == [0, 1, 2]
        assert {r["size"] for r in results} == {3}
        assert [r["local_rank"] for r in results] == [0, 1, 2]
        assert {(r["local_size"], r["cross_rank"], r["cross_size"]) for r in results} == {(3, 0, 1)}
        assert {r["sum"] for r in results} == {6.0}  # 1 + 2 + 3
        env = results[1]["env"]
        assert env["HOROVOD_RANK"] == "1" and env["HOROVOD_SIZE"] == "3"
        assert env["HOROVOD_HOSTNAME"] == results[1]["node_id"]
        assert env["HOROVOD_CONTROLLER"] == "gloo" and env["HOROVOD_CPU_OPERATIONS"] == "gloo"
        assert env["HOROVOD_GLOO_IFACE"] == "lo"  # the whole job is on one machine
        assert env["HOROVOD_GLOO_TIMEOUT_SECONDS"] == "60"
        host, port = executor.rendezvous_address
        assert env["HOROVOD_GLOO_RENDEZVOUS_ADDR"].startswith(f"{host}:{port}/")  # + secret
        assert env["HOROVOD_GLOO_RENDEZVOUS_PORT"] == str(port)
        assert executor.rendezvous_address[0] == "127.0.0.1"
        assert [info.world_rank for info in executor.ranks] == [0, 1, 2]

    def test_repeated_calls_reuse_the_same_workers(self, executor):
        first = executor.run(os.getpid)
        assert executor.run(os.getpid) == first
        assert len(set(first)) == 3

    def test_functions_are_kept_on_the_ranks_without_mixing_them_up(self, executor, monkeypatch):
        def make(value):
            return lambda _: value

        first, second = make("first"), make("second")  # same code, different captures
        for _ in range(2):
            assert executor.execute(first) == ["first"] * 3
            assert executor.execute_single(second) == "second"  # rank 0 only
            assert executor.execute(second) == ["second"] * 3
        # Past the cache size, functions still run, sent whole each time.
        monkeypatch.setattr(executor._now.kind._dispatcher, "_cache_size", 0)
        assert executor.execute(make("third")) == ["third"] * 3
        assert executor.execute(first) == ["first"] * 3

    def test_each_call_starts_from_the_functions_state_as_sent(self, executor):
        """A function that appends to a list it captured, run three times: it used to
        return [1, 1, 1], then [2, 2, 2], then [3, 3, 3] (the ranks kept the object)."""
        captured = []

        def step():
            captured.append(1)
            return len(captured)

        assert [executor.run(step) for _ in range(3)] == [[1, 1, 1]] * 3
        assert executor.execute(lambda _: step()) == [1, 1, 1]

    def test_calls_from_several_threads_each_get_their_own_function(self, executor):
        def make(value):
            return lambda: value

        def calls(value, results):
            fn = make(value // 2)  # two threads each: repeats, bare ones among them
            results.extend(executor.run(fn) == [value // 2] * 3 for _ in range(5))

        results: list[bool] = []
        threads = [threading.Thread(target=calls, args=(v, results)) for v in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert results == [True] * 20

    def test_run_passes_args_and_kwargs(self, executor):
        assert executor.run(lambda a, b=0: a * 10 + b, args=[4], kwargs={"b": 2}) == [42] * 3

    def test_run_remote_returns_refs_in_rank_order(self, executor):
        refs = executor.run_remote(lambda: int(os.environ["HOROVOD_RANK"]))
        assert all(isinstance(ref, ray.ObjectRef) for ref in refs)
        assert ray.get(refs) == [0, 1, 2]

    def test_run_remote_refs_raise_the_ranks_own_exception(self, executor, tmp_path):
        flag = tmp_path / "raise"

        def maybe_raises(path):
            if os.path.exists(path) and os.environ["HOROVOD_RANK"] == "1":
                raise KeyError("rank 1's own")
            return os.environ["HOROVOD_RANK"]

        # The first time it returns; the second goes as a repeat of that call.
        assert executor.run(maybe_raises, args=[str(flag)]) == ["0", "1", "2"]
        flag.touch()
        refs = executor.run_remote(maybe_raises, args=[str(flag)])
        with pytest.raises(KeyError, match="rank 1's own"):
            ray.get(refs[1])
        assert ray.get(refs[0]) == "0"
        assert executor.run(len, args=[()]) == [0, 0, 0]  # the job goes on

    def test_execute_single_runs_on_rank_zero_and_returns_a_value(self, executor):
        assert executor.execute_single(lambda _: os.environ["HOROVOD_RANK"]) == "0"

    def test_callbacks_get_rank_zero_logs_while_the_call_runs(self, executor, tmp_path):
        marker = tmp_path / "driver-saw-step-1"
        seen = []

        def on_log(metrics):
            seen.append(metrics)
            if metrics.get("step") == 1:
                marker.touch()

        def train(marker_path):
            rank = int(os.environ["HOROVOD_RANK"])
            log({"step": 1, "rank": rank})
            if rank != 0:
                return None
            # Rank 0 keeps running until the driver has handled step 1: only delivery
            # during the call lets this finish before the deadline.
            deadline = time.monotonic() + 60
            while not os.path.exists(marker_path) and time.monotonic() < deadline:
                time.sleep(0.05)
            log({"step": 2, "rank": rank})
            return os.path.exists(marker_path)

        results = executor.run(train, args=[str(marker)], callbacks=[on_log])
        assert results[0] is True
        assert seen == [{"step": 1, "rank": 0}, {"step": 2, "rank": 0}]

    def test_stacks_show_every_rank_mid_call_without_disturbing_it(self, executor, tmp_path):
        go = tmp_path / "go"
        refs = executor.run_remote(_waits_for, args=(str(go),))
        deadline = time.monotonic() + 30
        stacks = executor.stacks()
        # Until every rank is read in its sleep: a read while a rank checks for the file
        # (which lets other threads run) shows the loop's first line instead.
        while not all(SLEEP_LINE in text for text in stacks.values()):
            assert time.monotonic() < deadline, stacks
            stacks = executor.stacks()
        assert sorted(stacks) == [0, 1, 2]
        for text in stacks.values():
            # Each rank's waiting line, with its file and line, and the threads' names.
            assert re.search(rf'File "{re.escape(__file__)}", line \d+, in _waits_for', text)
            assert SLEEP_LINE in text
            assert 'Thread "' in text
        go.touch()
        assert ray.get(refs, timeout=30) == ["went on"] * 3  # the call was not disturbed

    def test_logs_outside_a_call_with_callbacks_are_dropped(self, executor):
        executor.run(lambda: log({"stale": True}))
        seen = []
        executor.run(lambda: log({"fresh": True}), callbacks=[seen.append])
        assert seen == [{"fresh": True}]

    def test_bad_call_arguments_raise_config_error(self, executor):
        with pytest.raises(ConfigError, match="fn must be callable") as info:
            executor.execute("not a function")
        assert info.value.parameter == "fn"
        with pytest.raises(ConfigError) as info:
            executor.run(len, args="abc")
        assert info.value.parameter == "args"
        with pytest.raises(ConfigError) as info:
            executor.run(len, kwargs={1: 2})
        assert info.value.parameter == "kwargs"
        with pytest.raises(ConfigError) as info:
            executor.run(len, callbacks=["print"])
        assert info.value.parameter == "callbacks"
        lock = threading.Lock()
        with pytest.raises(ConfigError, match="cannot be pickled") as info:
            executor.run(lambda: lock.locked())
        assert info.value.parameter == "fn"
        assert executor.state is ExecutorState.RUNNING
        assert executor.run(lambda: 1) == [1, 1, 1]


class Counter:
    def __init__(self, start, step=1):
        self.value = start + int(os.environ["HOROVOD_RANK"]) * step

    def bump(self):
        self.value += 1
        return self.value


def test_executable_cls_is_built_on_every_rank_after_the_env(ray_4cpu, no_leaks):
    with RayExecutor(SETTINGS, num_workers=2) as executor:
        pass
    executor = RayExecutor(SETTINGS, num_workers=2)
    executor.start(executable_cls=Counter, executable_args=[10], executable_kwargs={"step": 5})
    try:
        assert executor.execute(lambda counter: counter.bump()) == [11, 16]
        assert executor.execute(lambda counter: counter.value) == [11, 16]
    finally:
        executor.stop()


def bump_and_log(counter):
    value = counter.bump()
    log({"value": value})
    return value


def test_a_repeated_execute_sends_no_arguments_and_keeps_each_calls_logs(
    ray_4cpu, no_leaks, monkeypatch
):
    executor = RayExecutor(SETTINGS, num_workers=2)
    executor.start(executable_cls=Counter, executable_args=[0], executable_kwargs={"step": 10})
    try:
        again = []
        for worker in executor._now.kind.actors:
            method = worker.again_next
            monkeypatch.setattr(worker, "again_next", method)
            monkeypatch.setattr(method, "remote", _counting(method.remote, again))
        seen = []
        assert executor.execute(bump_and_log, callbacks=[seen.append]) == [1, 11]
        assert again == []  # the first call sends the function
        assert executor.execute(bump_and_log, callbacks=[seen.append]) == [2, 12]
        assert again == [(), ()]  # one call per rank, with no argument at all
        # Any call in between (here rank 0 only) ends the repeat: the function goes again.
        assert executor.execute_single(lambda counter: counter.value) == 2
        assert executor.execute(bump_and_log, callbacks=[seen.append]) == [3, 13]
        assert len(again) == 2
        assert executor.execute(bump_and_log, callbacks=[seen.append]) == [4, 14]
        assert executor.execute(lambda counter: counter.value) == [4, 14]  # another function
        assert len(again) == 4
        # Rank 0's call ids stayed in step with the driver's: every call got its own dict.
        assert seen == [{"value": 1}, {"value": 2}, {"value": 3}, {"value": 4}]
    finally:
        executor.stop()


def _counting(remote, calls):
    def counted(*args, **kwargs):
        calls.append(args)
        return remote(*args, **kwargs)

    return counted


def test_extra_env_vars_reach_every_rank(ray_4cpu, no_leaks):
    executor = RayExecutor(SETTINGS, num_workers=2)
    # Numbers and booleans pass as str(value), as horovod.ray passes them.
    env = {"MY_FLAG": "on", "HOROVOD_CYCLE_TIME": 1, "MY_RATE": 0.5, "MY_BOOL": True}
    executor.start(extra_env_vars=env)
    try:
        assert (
            executor.run(lambda: [os.environ[k] for k in env]) == [["on", "1", "0.5", "True"]] * 2
        )
    finally:
        executor.stop()


@pytest.mark.parametrize(
    "kwargs,parameter",
    [
        ({"executable_cls": 5}, "executable_cls"),
        ({"executable_args": "abc"}, "executable_args"),
        ({"executable_kwargs": [1]}, "executable_kwargs"),
        ({"extra_env_vars": {"A": [1]}}, "extra_env_vars"),
        ({"extra_env_vars": {"A": None}}, "extra_env_vars"),
        ({"extra_env_vars": ["A=1"]}, "extra_env_vars"),
        ({"extra_env_vars": {"HOROVOD_RANK": "3"}}, "extra_env_vars"),
    ],
)
def test_bad_start_arguments_take_nothing(ray_4cpu, no_leaks, kwargs, parameter):
    executor = RayExecutor(SETTINGS, num_workers=2)
    with pytest.raises(ConfigError) as info:
        executor.start(**kwargs)
    assert info.value.parameter == parameter
    assert executor.state is ExecutorState.CREATED


def test_wrong_state_calls_say_what_to_do(ray_4cpu, no_leaks):
    executor = RayExecutor(SETTINGS, num_workers=1)
    with pytest.raises(ExecutorStateError, match=r"call start\(\) first"):
        executor.run(len)
    with pytest.raises(ExecutorStateError, match=r"stacks needs a running executor"):
        executor.stacks()
    executor.start()
    with pytest.raises(ExecutorStateError, match="create a new RayExecutor"):
        executor.start()
    executor.stop()
    executor.stop()
    executor.shutdown()
    assert executor.state is ExecutorState.STOPPED
    with pytest.raises(ExecutorStateError, match="stopped; create a new RayExecutor"):
        executor.execute(lambda _: None)
    never_started = RayExecutor(SETTINGS, num_workers=1)
    never_started.stop()
    assert never_started.state is ExecutorState.STOPPED


def test_a_start_that_fails_once_the_ranks_are_up_releases_them(
    ray_4cpu, no_leaks, monkeypatch, tmp_path
):
    """The run's validations start last, once the ranks are up: started outside the
    rollback, a failure there left the actors and the placement group held."""
    from horovod_ray.checkpoints.job import JobCheckpoints

    def no_thread(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(JobCheckpoints, "start", no_thread)
    settings = RayExecutor.create_settings(timeout_s=60, storage_path=str(tmp_path), name="run")
    executor = RayExecutor(settings, num_workers=2)
    with pytest.raises(HorovodRayError, match="start\\(\\) failed: can't start new thread"):
        executor.start()
    assert executor.state in (ExecutorState.FAILED, ExecutorState.STOPPED)


def test_stop_releases_workers_group_and_rendezvous(ray_4cpu, no_leaks):
    import socket

    executor = RayExecutor(SETTINGS, num_workers=2)
    executor.start()
    group = executor.placement_group
    address = executor.rendezvous_address
    assert group.bundle_specs == [{"CPU": 1.0}, {"CPU": 1.0}]
    assert len(alive_actors()) >= 2
    executor.stop()
    # stop() returns once the workers are gone: no waiting needed here.
    assert alive_actors() == []
    assert ray.util.placement_group_table(group)["state"] == "REMOVED"
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(address, timeout=5).close()


def _note_exit(directory):
    """Registers an exit handler that records how the collector stands at exit."""
    import atexit
    import gc
    import json

    path = os.path.join(directory, f"exit-{os.environ['HOROVOD_RANK']}.json")
    # Objects the call leaves behind, tracked but not frozen at setup (the exit's own
    # freeze must take them).
    kept = [[index] for index in range(1000)]
    frozen_in_call = gc.get_freeze_count()

    def note():
        state = {
            "gc_enabled": gc.isenabled(),
            "frozen": gc.get_freeze_count(),
            "frozen_in_call": frozen_in_call,
            "kept": len(kept),
        }
        with open(path + ".part", "w") as handle:
            json.dump(state, handle)
        os.replace(path + ".part", path)  # the test polls for the file: whole or absent

    atexit.register(note)


def _when_stopping(executor, method, record, owner=None):
    """Wraps ``method`` of ``owner`` (by default ``executor``) so that it waits, after
    running, until another thread's stop() has moved the job on: the window a slow thread
    may be caught in."""
    original = getattr(executor if owner is None else owner, method)

    def wrapped(*args, **kwargs):
        value = original(*args, **kwargs)
        record.set()
        wait_until(lambda: executor.state is not ExecutorState.RUNNING, timeout_s=30)
        return value

    return wrapped


def test_a_call_admitted_as_stop_begins_is_counted_and_told_it_was_stopped(
    ray_4cpu, no_leaks, monkeypatch
):
    """Admitted, not yet counted in flight: stop() took the ranks for idle (a 5 s grace)
    and the call reported 'process died', blamed on the ranks stop() had killed."""
    executor = RayExecutor(SETTINGS, num_workers=2)
    executor.start()
    graces = []
    job_stop = executor._now.kind.stop
    monkeypatch.setattr(
        executor._now.kind, "stop", lambda grace_s: job_stop(graces.append(grace_s) or grace_s)
    )
    admitted = threading.Event()
    # The call admitted to the job (CallGate.job), not yet counted in flight.
    gate = executor._calls
    monkeypatch.setattr(gate, "job", _when_stopping(executor, "job", admitted, owner=gate))
    outcome = {}

    def call():
        try:
            outcome["value"] = executor.run(os.getpid)
        except BaseException as err:  # noqa: BLE001 - checked below
            outcome["error"] = err

    thread = threading.Thread(target=call)
    thread.start()
    assert admitted.wait(30)
    executor.stop()
    thread.join(60)
    assert graces[0] == 0  # busy: no grace for ranks that are running a call
    assert isinstance(outcome.get("error"), ExecutorStateError), outcome
    assert "stopped while it ran" in str(outcome["error"])
    assert executor.state is ExecutorState.STOPPED


def test_stop_while_another_thread_stops_returns_once_the_job_is_released(
    ray_4cpu, no_leaks, monkeypatch
):
    executor = RayExecutor(SETTINGS, num_workers=2)
    executor.start()
    job_stop = executor._now.kind.stop
    releasing = threading.Event()

    def slow_stop(grace_s):
        releasing.set()
        time.sleep(1.0)
        job_stop(grace_s)

    monkeypatch.setattr(executor._now.kind, "stop", slow_stop)
    first = threading.Thread(target=executor.stop)
    first.start()
    assert releasing.wait(30)
    executor.stop()  # used to return at once, the job still held
    assert executor.state is ExecutorState.STOPPED
    first.join(30)


def test_stopped_ranks_run_exit_handlers_and_skip_the_last_collections(
    ray_4cpu, no_leaks, tmp_path
):
    import json

    executor = RayExecutor(SETTINGS, num_workers=2)
    executor.start()
    executor.run(_note_exit, args=[str(tmp_path)])
    executor.stop()
    paths = [tmp_path / f"exit-{rank}.json" for rank in range(2)]
    assert wait_until(lambda: all(path.exists() for path in paths))
    for path in paths:
        state = json.loads(path.read_text())
        # The user's handler ran; the interpreter's teardown will not walk the objects
        # left (frozen), a walk that takes ~0.7 CPU-s once TensorFlow is loaded.
        assert state["gc_enabled"] is False and state["frozen"] > 0
        assert state["frozen"] >= state["frozen_in_call"] + state["kept"]


def test_a_raising_rank_fails_the_call_and_stops_the_job(ray_4cpu, no_leaks):
    def train():
        import horovod.torch as hvd
        import torch

        hvd.init()
        if hvd.rank() == 1:
            raise ValueError("bad batch on rank 1")
        # Rank 0 would wait in this collective until the Gloo timeout.
        return float(hvd.allreduce(torch.tensor(1.0)))

    executor = RayExecutor(RayExecutor.create_settings(timeout_s=120), num_workers=2)
    executor.start()
    started = time.monotonic()
    with pytest.raises(WorkerFailedError) as info:
        executor.run(train)
    assert time.monotonic() - started < 60  # far below the 120 s Gloo timeout
    assert list(info.value.failures) == [1]
    assert "ValueError: bad batch on rank 1" in info.value.failures[1]
    assert "in train" in info.value.failures[1]  # the traceback came along
    assert "\x1b[" not in info.value.failures[1]
    assert executor.state is ExecutorState.FAILED
    executor.stop()  # safe again
    with pytest.raises(ExecutorStateError, match="failed"):
        executor.run(len)


def test_a_raising_callback_stops_the_job(ray_4cpu, no_leaks):
    def boom(metrics):
        raise RuntimeError("callback broke")

    def train():
        log({"x": 1})
        time.sleep(30)

    executor = RayExecutor(SETTINGS, num_workers=2)
    executor.start()
    with pytest.raises(RuntimeError, match="callback broke"):
        executor.run(train, callbacks=[boom])
    assert executor.state is ExecutorState.FAILED


def test_ctrl_c_that_ray_reports_as_system_error_stays_a_keyboard_interrupt(ray_4cpu, no_leaks):
    # Ctrl-C landing as ray.wait returns reaches the driver as SystemError("... returned a
    # result with an exception set") caused by the KeyboardInterrupt (seen in
    # test_faults); the caller must see the KeyboardInterrupt.
    def interrupted_inside_ray(metrics):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as interrupt:
            raise SystemError("returned a result with an exception set") from interrupt

    def train():
        log({"x": 1})
        time.sleep(30)

    executor = RayExecutor(SETTINGS, num_workers=2)
    executor.start()
    with pytest.raises(KeyboardInterrupt):
        executor.run(train, callbacks=[interrupted_inside_ray])
    assert executor.state is ExecutorState.FAILED


class _RayInterruptedWhileWaiting:
    """Ray as the start's one wait (bringup.wait_all) sees it, but Ctrl-C lands in the wait
    the way CPython reports it."""

    def __getattr__(self, name):
        return getattr(ray, name)

    @staticmethod
    def wait(*args, **kwargs):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as interrupt:
            raise SystemError("returned a result with an exception set") from interrupt


def test_ctrl_c_while_placing_removes_the_group_and_stays_a_keyboard_interrupt(
    ray_4cpu, no_leaks, monkeypatch
):
    from horovod_ray.job import bringup

    monkeypatch.setattr(bringup, "ray", _RayInterruptedWhileWaiting())
    executor = RayExecutor(SETTINGS, num_workers=2)
    with pytest.raises(KeyboardInterrupt):
        executor.start()
    assert executor.state is ExecutorState.FAILED
    # no_leaks: the group created before the wait was removed.


def _start_in_thread(executor: RayExecutor) -> tuple[threading.Thread, list]:
    outcome: list = []

    def start() -> None:
        try:
            executor.start(executable_cls=SlowToBuild)
        except BaseException as err:  # noqa: BLE001 - the test reads it
            outcome.append(err)

    thread = threading.Thread(target=start)
    thread.start()
    return thread, outcome


class SlowToBuild:
    def __init__(self):
        time.sleep(20)


@pytest.mark.parametrize(
    "layout, stage",
    [
        ({"num_workers": 8}, "waiting for a placement group that cannot fit"),
        ({"num_workers": 2}, "building executable_cls on the ranks"),
    ],
)
def test_stop_during_start_makes_start_give_up_and_release(ray_4cpu, no_leaks, layout, stage):
    settings = RayExecutor.create_settings(timeout_s=60, placement_group_timeout_s=60)
    executor = RayExecutor(settings, **layout)
    thread, outcome = _start_in_thread(executor)
    assert wait_until(lambda: executor.state is ExecutorState.STARTING, timeout_s=10)
    time.sleep(2)  # well inside the stage named above
    executor.stop()
    thread.join(timeout=15)
    assert not thread.is_alive(), f"start() did not give up while {stage}"
    assert isinstance(outcome[0], StartCancelledError), outcome
    assert executor.state is ExecutorState.STOPPED
    with pytest.raises(ExecutorStateError):
        executor.run(lambda: 1)


def test_failing_executable_cls_releases_everything(ray_4cpu, no_leaks):
    class Broken:
        def __init__(self):
            raise OSError("no dataset here")

    executor = RayExecutor(SETTINGS, num_workers=2)
    with pytest.raises(WorkerFailedError, match="no dataset here"):
        executor.start(executable_cls=Broken)
    assert executor.state is ExecutorState.FAILED


def test_nested_inside_an_actor_that_holds_a_placement_group(ray_4cpu, no_leaks):
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = ray.util.placement_group([{"CPU": 1}, {"CPU": 1}], strategy="PACK")
    ray.get(group.ready())

    @ray.remote(num_cpus=0)
    class Trainer:
        def train(self):
            with RayExecutor(SETTINGS) as executor:
                ranks = executor.run(horovod_identity)
                group_id = executor.placement_group.id.hex()
            return [r["sum"] for r in ranks], group_id

    trainer = Trainer.options(
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_capture_child_tasks=True
        )
    ).remote()
    try:
        groups_before = len(live_placement_groups())
        sums, group_id = ray.get(trainer.train.remote())
        assert sums == [3.0, 3.0]  # the two bundles gave two ranks
        assert group_id == group.id.hex()
        assert len(live_placement_groups()) == groups_before  # none created
    finally:
        ray.kill(trainer)
        ray.util.remove_placement_group(group)


def test_start_without_ray_says_to_call_ray_init():
    code = (
        "from horovod_ray import RayExecutor, HorovodRayError\n"
        "import ray\n"
        "try:\n"
        "    RayExecutor(num_workers=1).start()\n"
        "except HorovodRayError as err:\n"
        "    print('ERR', err)\n"
        "print('INIT', ray.is_initialized())\n"
    )
    out = run_fresh_python(code, timeout_s=120)
    assert "ERR Ray is not initialised: call ray.init()" in out
    assert "INIT False" in out


def test_start_logs_one_table_of_ranks_at_info(ray_4cpu, no_leaks, caplog):
    with caplog.at_level(logging.INFO, logger="horovod_ray.executor"):
        with RayExecutor(SETTINGS, num_workers=2) as executor:
            host, port = executor.rendezvous_address
            secret = executor._now.kind.rendezvous.worker_address.rsplit("/", 1)[1]
    started = [r.getMessage() for r in caplog.records if "Horovod job started" in r.getMessage()]
    assert len(started) == 1
    assert f"rendezvous {host}:{port}" in started[0]
    assert len(started[0].splitlines()) == 4  # the heading, the table's head, 2 ranks
    assert all(secret not in r.getMessage() for r in caplog.records)  # never logged
