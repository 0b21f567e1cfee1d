"""Every public entry point, every parameter, given what a user gets wrong: wrong types,
negatives, zero, inf, nan, huge values, empty and malformed containers. Each must be a
``ConfigError`` naming the parameter (the command line: exit status 2 naming the flag),
raised before Ray is touched. No Ray here: a test that started it fails (conftest)."""

from __future__ import annotations

import math

import pytest

import horovod_ray
from horovod_ray import ConfigError, RayExecutor
from horovod_ray.cli.main import main
from horovod_ray.tune import DistributedTrainableCreator

pytestmark = pytest.mark.unit  # pure logic: no Ray (make test runs these first)


@pytest.fixture(autouse=True)
def no_ray(monkeypatch):
    """Bad input must be refused before Ray is touched: touching it fails the test at
    once (rather than starting a Ray, or reserving 10**30 bundles)."""
    import ray
    import ray.util

    def refuse(*args, **kwargs):
        raise AssertionError("Ray was touched before the bad input was refused")

    for module, name in ((ray, "init"), (ray.util, "placement_group")):
        monkeypatch.setattr(module, name, refuse)


INF, NAN = math.inf, math.nan

# Bad values by what a parameter is.
COUNT = [0, -1, 1.5, "2", True, INF, NAN, 10**30, [], {}, None]
COUNT_OR_NONE = [v for v in COUNT if v is not None]
SECONDS = [0, -1, "5", True, INF, NAN, 1e300, [], {}]
SECONDS_OR_NONE = SECONDS
AMOUNT = [0, -1, "1", True, INF, NAN, 1e30, [], None]
FLAG = ["yes", 1, 0, None, [], INF]
NICS = [3, [], [""], {"eth0", "ens5"}, [1], {"eth0": 1}]
ENV = [["A=1"], {"": "x"}, {1: "x"}, {"A": object()}, {"HOROVOD_RANK": "1"}, "A=1"]
CALLBACKS = [5, [5], "f", {1: 2}]
ARGS = ["ab", 5, {"a": 1}]
KWARGS = [[1], {1: 2}, "x"]
HOSTS = [[], [5], "a:2", [("a",)], [("a", 0)], {}, [("", 1)], [("a", 2), 5], [("a", 1.5)]]
COOLDOWN = [(0, 5), 5, "ab", (5, 1), [], (1, 2, 3), (1.5, 2), (1, 10**6)]
RESET_LIMIT = [-1, 1.5, "3", INF, NAN, []]
NICENESS = [-1, 20, 0.0, "0", False, INF, NAN]
VERBOSE = [-1, "loud", 1.5, INF, NAN, None]


def _cases(table: dict[str, tuple[list, dict]]) -> list:
    """(parameter, bad value, the other arguments it needs) for every bad value."""
    return [
        pytest.param(name, value, base, id=f"{name}={value!r}"[:60])
        for name, (values, base) in table.items()
        for value in values
    ]


EXECUTOR = {
    "num_workers": (COUNT_OR_NONE, {}),
    "num_hosts": (COUNT_OR_NONE, {}),
    "num_workers_per_host": (COUNT, {"num_hosts": 2}),
    "cpus_per_worker": (AMOUNT, {"num_workers": 2}),
    "use_gpu": (FLAG, {"num_workers": 2}),
    "gpus_per_worker": ([v for v in AMOUNT if v is not None], {"num_workers": 2, "use_gpu": True}),
    "use_current_placement_group": (FLAG, {"num_workers": 2}),
    "min_workers": (COUNT_OR_NONE, {}),
    "max_workers": (COUNT_OR_NONE, {"min_workers": 1}),
    "reset_limit": (RESET_LIMIT, {"min_workers": 1}),
    "cooldown_range": (COOLDOWN, {"min_workers": 1}),
    "elastic_timeout": (SECONDS, {"min_workers": 1}),
    "discovery_interval_s": (SECONDS, {"min_workers": 1}),
    "hosts": (HOSTS, {}),
    "override_discovery": ([False, 5, "all", {"a": 1}], {"min_workers": 1}),
    # horovod.ray's older names (None: not given).
    "num_slots": (COUNT_OR_NONE, {"num_hosts": 2}),
    "cpus_per_slot": ([v for v in AMOUNT if v is not None], {"num_workers": 2}),
    "gpus_per_slot": ([v for v in AMOUNT if v is not None], {"num_workers": 2, "use_gpu": True}),
}


@pytest.mark.parametrize("name, value, base", _cases(EXECUTOR))
def test_the_executor_names_every_bad_argument(name, value, base):
    base = base if name in ("num_workers", "num_hosts", "hosts", "min_workers") else base
    kwargs = {**({"num_workers": 2} if not base and name != "num_workers" else {}), **base}
    if name in ("num_hosts", "hosts", "min_workers"):
        kwargs.pop("num_workers", None)
    with pytest.raises(ConfigError) as info:
        RayExecutor(**{**kwargs, name: value})
    assert info.value.parameter == name, info.value
    assert name in str(info.value)


SETTINGS = {
    "timeout_s": (SECONDS, {}),
    "ssh_identity_file": ([5, ["k"], b"key"], {}),
    "ssh_str": ([5, ["k"], b"key"], {}),
    "placement_group_timeout_s": (SECONDS + [None], {}),
    "nics": (NICS, {}),
    "verbose": (VERBOSE, {}),
    "stall_timeout_s": ([-1, "5", True, INF, NAN, 1e300, [], None], {}),
    "niceness": (NICENESS, {}),
}


@pytest.mark.parametrize("name, value, base", _cases(SETTINGS))
def test_create_settings_names_every_bad_argument(name, value, base):
    with pytest.raises(ConfigError) as info:
        RayExecutor.create_settings(**{name: value})
    assert info.value.parameter == name, info.value
    assert name in str(info.value)


RUN = {
    "train_fn": ([5, None, "train"], {}),
    "args": (ARGS, {}),
    "kwargs": (KWARGS, {}),
    "num_hosts": (COUNT_OR_NONE, {}),
    "num_slots": (COUNT_OR_NONE, {}),
    "cpus_per_slot": (AMOUNT, {}),
    "use_gpu": (FLAG, {}),
    "timeout_s": (SECONDS, {}),
    "nics": (NICS, {}),
    "env": (ENV, {}),
    "callbacks": (CALLBACKS, {}),
    "min_workers": (COUNT_OR_NONE, {}),
    "max_workers": (COUNT_OR_NONE, {"min_workers": 1}),
    "reset_limit": (RESET_LIMIT, {"min_workers": 1}),
    "elastic_timeout": (SECONDS, {"min_workers": 1}),
    "cooldown_range": (COOLDOWN, {"min_workers": 1}),
    "discovery_interval_s": (SECONDS, {"min_workers": 1}),
    "max_restarts": ([-1, 1.5, "1", INF, NAN, None], {}),
    "stall_timeout_s": ([-1, "5", INF, NAN, 1e300, None], {}),
    "niceness": (NICENESS, {}),
    "placement_group_timeout_s": (SECONDS + [None], {}),
}


@pytest.mark.parametrize("name, value, base", _cases(RUN))
def test_run_names_every_bad_argument(name, value, base):
    kwargs = {"train_fn": len, **base, name: value}
    with pytest.raises(ConfigError) as info:
        horovod_ray.run(**kwargs)
    assert info.value.parameter == name, info.value
    assert name in str(info.value)


def _train(config):
    return config


TUNE = {
    "func": ([5, None, lambda: None, lambda a, b: None], {}),
    "num_hosts": (COUNT, {}),
    "num_slots": (COUNT, {}),
    "num_cpus_per_slot": (AMOUNT, {}),
    "use_gpu": (FLAG, {}),
    "timeout_s": (SECONDS, {}),
}


@pytest.mark.parametrize("name, value, base", _cases(TUNE))
def test_the_tune_creator_names_every_bad_argument(name, value, base):
    kwargs = {"func": _train, **base, name: value}
    with pytest.raises(ConfigError) as info:
        DistributedTrainableCreator(**kwargs)
    assert info.value.parameter == name, info.value
    assert name in str(info.value)


# A flag, a bad value, and the name the error must carry (the flag itself).
CLI = [
    (flag, value)
    for flag, values in {
        "-np": ["0", "-1", "x", "1.5", "inf", "nan", "1" + "0" * 30],
        "--num-hosts": ["0", "-2", "x", "1" + "0" * 30],
        "--cpus-per-worker": ["0", "-1", "x", "inf", "nan", "1e30"],
        "--gpus-per-worker": ["0", "-1", "inf", "nan"],
        "--stall-timeout-seconds": ["-1", "inf", "nan", "1e300", "x"],
        "--gloo-timeout-seconds": ["0", "-1", "inf", "x"],
        "--start-timeout": ["0", "-1", "inf", "nan", "x"],
        "--max-restarts": ["-1", "x", "1.5"],
        "--min-np": ["0", "-1", "x"],
        "--elastic-timeout": ["0", "-1", "x"],
        "--reset-limit": ["-1", "x"],
        "--network-interfaces": [""],
        "--env": ["NOEQUALS", "=x", "HOROVOD_RANK=3"],
    }.items()
    for value in values
]


@pytest.mark.parametrize("flag, value", CLI, ids=[f"{f} {v}"[:40] for f, v in CLI])
def test_the_command_line_names_every_bad_flag(flag, value, capsys):
    extra = ["--min-np", "2"] if flag in ("--elastic-timeout", "--reset-limit") else []
    size = [] if flag in ("-np", "--num-hosts", "--min-np") else ["-np", "2"]
    argv = ["run", *size, *extra, flag, value, "python", "-c", "pass"]
    try:
        status = main(argv)
    except SystemExit as exited:  # argparse's own refusal of a type it cannot read
        status = exited.code
    assert status == 2
    err = capsys.readouterr().err
    assert flag in err or flag.lstrip("-") in err, err
