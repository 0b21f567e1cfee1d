"""Settings and layout validation: bad values name the parameter, no Ray involved."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from horovod_ray import ConfigError, RayExecutor, Settings
from horovod_ray import settings as settings_module

pytestmark = pytest.mark.unit  # pure logic: no Ray (make test runs these first)

BAD_SETTINGS = [
    ({"timeout_s": 0}, "timeout_s"),
    ({"timeout_s": -5}, "timeout_s"),
    ({"timeout_s": "60"}, "timeout_s"),
    ({"timeout_s": True}, "timeout_s"),
    ({"placement_group_timeout_s": 0}, "placement_group_timeout_s"),
    ({"placement_group_timeout_s": None}, "placement_group_timeout_s"),
    ({"nics": 3}, "nics"),
    ({"nics": {"eth0": 1}}, "nics"),
    ({"nics": []}, "nics"),
    ({"nics": [""]}, "nics"),
    ({"nics": {"eth0", "ens5"}}, "nics"),  # a set has no order of preference
    ({"verbose": -1}, "verbose"),
    ({"verbose": "loud"}, "verbose"),
    ({"stall_timeout_s": -1}, "stall_timeout_s"),
    ({"stall_timeout_s": None}, "stall_timeout_s"),
    ({"stall_timeout_s": "60"}, "stall_timeout_s"),
    ({"niceness": -1}, "niceness"),  # ahead of Ray's own processes
    ({"niceness": 20}, "niceness"),
    ({"niceness": 0.0}, "niceness"),
    ({"niceness": "0"}, "niceness"),
    ({"niceness": False}, "niceness"),
    # Not finite, or past a year: they used to pass, and fail once Ray resources were taken
    # (timeout_s=inf: "cannot convert float infinity to integer").
    ({"timeout_s": float("inf")}, "timeout_s"),
    ({"timeout_s": float("nan")}, "timeout_s"),
    ({"timeout_s": 1e300}, "timeout_s"),
    ({"placement_group_timeout_s": float("inf")}, "placement_group_timeout_s"),
    ({"placement_group_timeout_s": float("nan")}, "placement_group_timeout_s"),
    ({"stall_timeout_s": float("inf")}, "stall_timeout_s"),
    ({"stall_timeout_s": float("nan")}, "stall_timeout_s"),
    ({"stall_timeout_s": 10**12}, "stall_timeout_s"),
]

BAD_LAYOUTS = [
    ({"num_workers": 0}, "num_workers"),
    ({"num_workers": -2}, "num_workers"),
    ({"num_workers": 2.0}, "num_workers"),
    ({"num_workers": 2, "num_hosts": 1}, "num_workers"),
    ({"num_hosts": 0}, "num_hosts"),
    ({"num_hosts": 2, "num_workers_per_host": 0}, "num_workers_per_host"),
    ({"num_hosts": 2, "num_workers_per_host": None}, "num_workers_per_host"),
    ({"num_workers": 2, "cpus_per_worker": 0}, "cpus_per_worker"),
    ({"num_workers": 2, "cpus_per_worker": -1}, "cpus_per_worker"),
    ({"num_workers": 2, "gpus_per_worker": 1}, "gpus_per_worker"),
    ({"num_workers": 2, "use_gpu": True, "gpus_per_worker": 0}, "gpus_per_worker"),
    ({"num_workers": 2, "use_gpu": "yes"}, "use_gpu"),
    ({"num_workers": 2, "use_current_placement_group": 1}, "use_current_placement_group"),
    ({"use_current_placement_group": False}, "num_workers"),
    ({"num_workers": 2, "cpus_per_worker": float("nan")}, "cpus_per_worker"),
    ({"num_workers": 2, "cpus_per_worker": float("inf")}, "cpus_per_worker"),
    ({"num_workers": 2, "use_gpu": True, "gpus_per_worker": float("nan")}, "gpus_per_worker"),
    # Elastic waits: nan made discovery never read the node table.
    ({"min_workers": 2, "discovery_interval_s": float("nan")}, "discovery_interval_s"),
    ({"min_workers": 2, "discovery_interval_s": float("inf")}, "discovery_interval_s"),
    ({"min_workers": 2, "elastic_timeout": float("inf")}, "elastic_timeout"),
    ({"min_workers": 2, "elastic_timeout": float("nan")}, "elastic_timeout"),
    # Malformed hosts: a bare TypeError ('int' object is not iterable) before.
    ({"hosts": [("a", 2), 5]}, "hosts"),
    ({"hosts": [5]}, "hosts"),
    ({"hosts": ["ab"]}, "hosts"),
    ({"hosts": [("a", 2, 3)]}, "hosts"),
    ({"hosts": "a:2"}, "hosts"),
]


@pytest.mark.parametrize("kwargs,parameter", BAD_SETTINGS, ids=lambda v: str(v))
def test_bad_settings_name_the_parameter(kwargs, parameter):
    with pytest.raises(ConfigError) as info:
        RayExecutor.create_settings(**kwargs)
    assert info.value.parameter == parameter
    assert parameter in str(info.value)


@pytest.mark.parametrize("kwargs,parameter", BAD_LAYOUTS, ids=lambda v: str(v))
def test_bad_layouts_name_the_parameter(kwargs, parameter):
    with pytest.raises(ConfigError) as info:
        RayExecutor(RayExecutor.create_settings(), **kwargs)
    assert info.value.parameter == parameter
    assert parameter in str(info.value)


def test_a_duration_says_it_must_be_finite_and_what_zero_means():
    with pytest.raises(ConfigError, match=r"timeout_s must be a finite number of seconds > 0"):
        RayExecutor.create_settings(timeout_s=float("inf"))
    with pytest.raises(ConfigError, match=r"\(0: no hang detection\), got nan"):
        RayExecutor.create_settings(stall_timeout_s=float("nan"))
    with pytest.raises(ConfigError, match=r"at most 31536000 seconds \(a year\), got 1e\+300"):
        RayExecutor.create_settings(timeout_s=1e300)
    year = settings_module.MAX_SECONDS
    assert RayExecutor.create_settings(timeout_s=year, stall_timeout_s=0).timeout_s == year


@pytest.mark.parametrize(
    "kwargs, parameter, executors",
    [
        ({"num_slots": 0}, "num_slots", "num_workers_per_host"),
        ({"cpus_per_slot": float("nan")}, "cpus_per_slot", "cpus_per_worker"),
        ({"env": {"HOROVOD_RANK": "3"}}, "env", "extra_env_vars"),
        ({"env": ["A=1"]}, "env", "extra_env_vars"),
    ],
)
def test_run_names_its_own_parameters_not_the_executors(kwargs, parameter, executors):
    import horovod_ray

    with pytest.raises(ConfigError) as info:
        horovod_ray.run(len, **kwargs)
    assert info.value.parameter == parameter
    assert parameter in str(info.value) and executors not in str(info.value)


def test_create_settings_takes_horovod_rays_positional_order():
    """horovod.ray: create_settings(timeout_s, ssh_identity_file, ssh_str,
    placement_group_timeout_s, nics); the rest of ours are keyword-only."""
    settings = RayExecutor.create_settings(60, None, None, 30, ["lo"])
    assert (settings.timeout_s, settings.placement_group_timeout_s) == (60, 30)
    assert settings.nics == ("lo",)
    with pytest.raises(ConfigError, match="pass the others by name") as info:
        RayExecutor.create_settings(60, 30)  # our old order: placement_group_timeout_s second
    assert info.value.parameter == "ssh_identity_file"
    with pytest.raises(TypeError):
        RayExecutor.create_settings(60, None, None, 30, None, 2)  # verbose: by name only


def test_config_error_is_a_value_error_with_the_fix():
    with pytest.raises(ValueError, match=r"num_workers must be > 0, got 0"):
        RayExecutor(num_workers=0)


def test_settings_must_come_from_create_settings():
    with pytest.raises(ConfigError, match="create_settings") as info:
        RayExecutor({"timeout_s": 10}, num_workers=1)
    assert info.value.parameter == "settings"


def test_settings_are_frozen_and_normalized():
    settings = RayExecutor.create_settings(timeout_s=30, nics={"lo"})
    assert settings == Settings(timeout_s=30, nics=("lo",))
    assert settings.nics == ("lo",)
    assert RayExecutor.create_settings(nics="lo").nics == ("lo",)
    # An order of preference, kept as given (duplicates dropped); which node has which
    # interface is only known at start.
    ordered = RayExecutor.create_settings(nics=["ens5", "eth0", "ens5", "no-such-nic0"])
    assert ordered.nics == ("ens5", "eth0", "no-such-nic0")
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.timeout_s = 1


def test_ssh_arguments_are_accepted_ignored_and_warned_once(caplog, tmp_path, monkeypatch):
    monkeypatch.setattr(settings_module, "_ssh_warned", False)
    with caplog.at_level(logging.WARNING, logger="horovod_ray.settings"):
        first = RayExecutor.create_settings(ssh_identity_file=str(tmp_path / "id"), ssh_str="KEY")
        RayExecutor.create_settings(ssh_str="KEY")
    assert [r.message for r in caplog.records].count(
        "ssh_identity_file / ssh_str are ignored: Ray starts the workers, no SSH is used"
    ) == 1
    assert "KEY" not in repr(first)
    assert list(tmp_path.iterdir()) == []


def test_valid_layouts_are_accepted():
    assert RayExecutor(num_workers=3, cpus_per_worker=0.5).layout.worker_resources() == {"CPU": 0.5}
    spread = RayExecutor(num_hosts=2, num_workers_per_host=4).layout
    assert (spread.num_hosts, spread.num_workers_per_host) == (2, 4)
    gpus = RayExecutor(num_workers=2, use_gpu=True, gpus_per_worker=0.5).layout
    assert gpus.worker_resources() == {"CPU": 1.0, "GPU": 0.5}
    # Counts may come from an enclosing placement group at start().
    assert RayExecutor().layout.num_workers is None


def test_none_for_an_unused_count_is_accepted_as_horovod_ray_does():
    # horovod.ray's own tests pass exactly this.
    layout = RayExecutor(num_workers=4, num_workers_per_host=None).layout
    assert (layout.num_workers, layout.num_hosts, layout.num_workers_per_host) == (4, None, 1)
    assert RayExecutor(num_workers=None, num_hosts=2, num_workers_per_host=2).layout.num_hosts == 2


def test_niceness_from_horovodrun_s_priority_to_the_lowest_or_none_is_accepted():
    assert RayExecutor.create_settings().niceness is None
    assert [RayExecutor.create_settings(niceness=n).niceness for n in (0, 19)] == [0, 19]


def test_the_storage_keeps_its_name_among_horovod_rays_parameters(tmp_path):
    """create_settings once named a loop variable ``name``: every run was called "ssh_str"."""
    settings = RayExecutor.create_settings(60, None, None, storage_path=str(tmp_path), name="run")
    assert (settings.storage.name, settings.storage.run_path) == ("run", f"{tmp_path}/run")
    assert RayExecutor.create_settings().storage is None
