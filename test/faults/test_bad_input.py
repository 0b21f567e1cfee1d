"""A table of invalid calls across the whole API: each raises the documented error, names
the parameter, and creates no Ray resource at all (not even briefly)."""

from __future__ import annotations

import threading

import pytest

import horovod_ray
from horovod_ray import ConfigError, ExecutorStateError, RayExecutor
from horovod_ray.tune import DistributedTrainableCreator
from test.conftest import all_actors, all_placement_groups, start_local_ray

_LOCK = threading.Lock()


def _config(config):
    return config


def _two(config, other):
    return config


def _executor(**kwargs):
    return RayExecutor(RayExecutor.create_settings(), **kwargs)


def _started_call(method, *args, **kwargs):
    """Calls a method of an executor that was never started."""
    return getattr(_executor(num_workers=1), method)(*args, **kwargs)


# (call, expected error, parameter named)
CASES = {
    "settings timeout zero": (lambda: RayExecutor.create_settings(timeout_s=0), "timeout_s"),
    "settings timeout text": (lambda: RayExecutor.create_settings(timeout_s="9"), "timeout_s"),
    "settings pg timeout negative": (
        lambda: RayExecutor.create_settings(placement_group_timeout_s=-1),
        "placement_group_timeout_s",
    ),
    "settings nics int": (lambda: RayExecutor.create_settings(nics=7), "nics"),
    "settings nics unordered set": (
        lambda: RayExecutor.create_settings(nics={"eth0", "ens5"}),
        "nics",
    ),
    "settings nics empty": (lambda: RayExecutor.create_settings(nics=set()), "nics"),
    "settings verbose negative": (lambda: RayExecutor.create_settings(verbose=-3), "verbose"),
    "executor settings dict": (lambda: RayExecutor({}, num_workers=1), "settings"),
    "executor zero workers": (lambda: _executor(num_workers=0), "num_workers"),
    "executor negative workers": (lambda: _executor(num_workers=-1), "num_workers"),
    "executor float workers": (lambda: _executor(num_workers=1.5), "num_workers"),
    "executor both counts": (lambda: _executor(num_workers=2, num_hosts=2), "num_workers"),
    "executor zero hosts": (lambda: _executor(num_hosts=0), "num_hosts"),
    "executor zero per host": (
        lambda: _executor(num_hosts=1, num_workers_per_host=0),
        "num_workers_per_host",
    ),
    "executor zero cpus": (lambda: _executor(num_workers=1, cpus_per_worker=0), "cpus_per_worker"),
    "executor gpus without use_gpu": (
        lambda: _executor(num_workers=1, gpus_per_worker=1),
        "gpus_per_worker",
    ),
    "executor neither count outside a group": (
        lambda: _executor(use_current_placement_group=False),
        "num_workers",
    ),
    "start executable not callable": (
        lambda: _executor(num_workers=1).start(executable_cls=3),
        "executable_cls",
    ),
    "start args a string": (
        lambda: _executor(num_workers=1).start(executable_args="ab"),
        "executable_args",
    ),
    "start executable args unpicklable": (
        lambda: _executor(num_workers=1).start(executable_cls=dict, executable_args=[_LOCK]),
        "executable_cls",
    ),
    "start env list value": (
        lambda: _executor(num_workers=1).start(extra_env_vars={"A": [1]}),
        "extra_env_vars",
    ),
    "start env not a dict": (
        lambda: _executor(num_workers=1).start(extra_env_vars=[("A", "1")]),
        "extra_env_vars",
    ),
    "start env managed key": (
        lambda: _executor(num_workers=1).start(extra_env_vars={"HOROVOD_SIZE": "8"}),
        "extra_env_vars",
    ),
    "execute not callable": (lambda: _started_call("execute", 42), "fn"),
    "run unpicklable fn": (lambda: _started_call("run", lambda: _LOCK.locked()), "fn"),
    "run args not a list": (lambda: _started_call("run", len, args=5), "args"),
    "run kwargs int keys": (lambda: _started_call("run", len, kwargs={1: 1}), "kwargs"),
    "run callbacks not callables": (
        lambda: _started_call("run", len, callbacks=[1]),
        "callbacks",
    ),
    "run_remote unpicklable args": (
        lambda: _started_call("run_remote", len, args=[_LOCK]),
        "args",
    ),
    "execute_single not callable": (lambda: _started_call("execute_single", None), "fn"),
    "run() zero slots": (lambda: horovod_ray.run(len, num_slots=0), "num_slots"),
    "run() negative timeout": (lambda: horovod_ray.run(len, timeout_s=-1), "timeout_s"),
    "run() env list": (lambda: horovod_ray.run(len, env=["A=1"]), "env"),
    "run() unpicklable kwargs": (
        lambda: horovod_ray.run(len, kwargs={"lock": _LOCK}),
        "args",
    ),
    "tune zero hosts": (lambda: DistributedTrainableCreator(_config, num_hosts=0), "num_hosts"),
    "tune zero slots": (lambda: DistributedTrainableCreator(_config, num_slots=0), "num_slots"),
    "tune not callable": (lambda: DistributedTrainableCreator("train"), "func"),
    "tune two arguments": (lambda: DistributedTrainableCreator(_two), "func"),
    "tune zero cpus": (
        lambda: DistributedTrainableCreator(_config, num_cpus_per_slot=0),
        "num_cpus_per_slot",
    ),
}


@pytest.fixture(scope="module")
def baseline():
    start_local_ray(4)
    return len(all_actors()), len(all_placement_groups())


@pytest.mark.parametrize("call,parameter", CASES.values(), ids=CASES.keys())
def test_bad_input_names_the_parameter_and_takes_nothing(baseline, call, parameter):
    with pytest.raises(ConfigError) as info:
        call()
    assert info.value.parameter == parameter
    assert parameter in str(info.value)
    # Counted over every state, dead included: nothing was created even for a moment.
    assert (len(all_actors()), len(all_placement_groups())) == baseline


def test_calls_on_a_never_started_executor_are_state_errors(baseline):
    with pytest.raises(ExecutorStateError, match=r"call start\(\) first"):
        _started_call("run", len)
    assert (len(all_actors()), len(all_placement_groups())) == baseline


def test_horovod_without_gloo_names_the_install_command(monkeypatch, baseline):
    from horovod_ray import HorovodRayError

    # Stands in for a horovod build without Gloo: its extension lacks the Gloo controller.
    from horovod_ray.stack import build

    monkeypatch.setattr(build, "_GLOO_MARKER", b"no-such-controller-in-this-build")
    build._gloo_problem.cache_clear()
    try:
        with pytest.raises(HorovodRayError) as info:
            _executor(num_workers=1).start()
    finally:
        build._gloo_problem.cache_clear()
    assert "horovod was built without Gloo" in str(info.value)
    assert "HOROVOD_WITH_GLOO=1" in str(info.value) and "pip install" in str(info.value)
    assert (len(all_actors()), len(all_placement_groups())) == baseline
