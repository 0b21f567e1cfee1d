"""horovod.ray's names and older arguments, as code written for it uses them (no Ray)."""

from __future__ import annotations

import importlib
import warnings

import horovod.ray
import pytest

import horovod_ray
from horovod_ray import ConfigError, ElasticRayExecutor, RayExecutor
from horovod_ray.elastic import RayHostDiscovery, hosts_and_slots

pytestmark = pytest.mark.unit


def _public(module) -> list[str]:
    return sorted({*module.__all__, *(n for n in dir(module) if not n.startswith("_"))})


@pytest.mark.parametrize("name", _public(horovod.ray))
def test_every_name_horovod_ray_exports_imports_or_says_what_to_use(name):
    """Walks the installed horovod.ray (0.28.1): each public name is ours with the same
    meaning, or an ImportError saying what to use instead, also through ``from ... import``."""
    theirs = getattr(horovod.ray, name)
    try:
        ours = getattr(importlib.import_module("horovod_ray"), name)
    except ImportError as err:
        assert "use " in str(err) and name in str(err)
        with pytest.raises(ImportError, match="use "):
            exec(f"from horovod_ray import {name}", {})
        return
    if isinstance(theirs, type):  # a class: the same public methods (and create_settings)
        wanted = {m for m in vars(theirs) if not m.startswith("_")}
        assert wanted <= set(dir(ours)), wanted - set(dir(ours))
    else:  # a module: every name defined there that users call
        own = {
            n
            for n, v in vars(theirs).items()
            if not n.startswith("_") and getattr(v, "__module__", None) == theirs.__name__
        }
        assert own - {"configure"} <= set(dir(ours)), own - set(dir(ours))
    assert name in dir(horovod_ray) or name in ("elastic", "ray_logger")


def test_ray_loggers_dicts_come_from_every_rank_of_an_elastic_job(monkeypatch, fresh_rank_session):
    """horovod.ray's elastic executor delivered every rank's ray_logger.log dicts;
    horovod_ray.log delivers rank 0's."""
    from horovod_ray import ray_logger
    from horovod_ray.rank import logs

    monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    monkeypatch.setenv("HOROVOD_RANK", "1")
    logs.open_channel(is_log_rank=False)
    logs.begin(1)
    horovod_ray.log({"from": "log"})  # rank 1: dropped
    ray_logger.log({"from": "ray_logger"})
    logs.end(1)
    assert logs.take(1, 0) == ([{"from": "ray_logger"}], True)
    with pytest.raises(ConfigError, match="takes a dict") as info:
        ray_logger.log(["not", "a", "dict"])
    assert info.value.parameter == "info_dict"


def test_older_constructor_names_are_todays_with_a_warning():
    with pytest.warns(DeprecationWarning, match=r"give num_hosts=2, num_workers_per_host=4 "):
        executor = RayExecutor(num_hosts=2, num_slots=4, cpus_per_slot=8, use_gpu=False)
    assert (executor.layout.num_hosts, executor.layout.num_workers_per_host) == (2, 4)
    assert executor.layout.cpus_per_worker == 8
    with pytest.warns(DeprecationWarning, match="gpus_per_slot"):
        executor = RayExecutor(num_workers=2, use_gpu=True, gpus_per_slot=0.5)
    assert executor.layout.gpus == 0.5
    # horovod 0.20's num_hosts defaulted to 1, as run()'s does.
    with pytest.warns(DeprecationWarning, match=r"num_hosts=1, num_workers_per_host=3"):
        assert RayExecutor(num_slots=3).layout.num_hosts == 1


@pytest.mark.parametrize(
    "kwargs, parameter, says",
    [
        ({"num_slots": 0}, "num_slots", "num_slots must be"),
        ({"num_hosts": 1, "num_slots": 2, "num_workers_per_host": 3}, "num_slots", "clash"),
        ({"num_workers": 4, "num_slots": 2}, "num_slots", "goes with num_hosts, not num_workers"),
        ({"min_workers": 2, "num_slots": 2}, "num_slots", "not min_workers"),
        ({"num_workers": 2, "cpus_per_slot": 2, "cpus_per_worker": 3}, "cpus_per_slot", "clash"),
        ({"num_workers": 2, "cpus_per_slot": float("nan")}, "cpus_per_slot", "finite"),
    ],
)
def test_older_names_that_do_not_fit_name_themselves(kwargs, parameter, says):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(ConfigError, match=says) as info:
            RayExecutor(**kwargs)
    assert info.value.parameter == parameter


def test_verbose_takes_booleans_as_horovod_ray_does():
    assert RayExecutor.create_settings(verbose=True).verbose == 1
    assert RayExecutor.create_settings(verbose=False).verbose == 0
    with pytest.raises(ConfigError, match="verbose"):
        RayExecutor.create_settings(verbose="yes")


def test_elastic_settings_and_executor_are_the_elastic_jobs():
    with pytest.warns(DeprecationWarning, match="min_np is deprecated"):
        settings = ElasticRayExecutor.create_settings(
            min_np=2, max_num_proc=6, reset_limit=3, elastic_timeout=60, verbose=True,
            cooldown_range=(1, 5), nics=["lo"],
        )  # fmt: skip
    assert (settings.min_num_proc, settings.max_num_proc, settings.verbose) == (2, 6, 1)
    with pytest.warns(DeprecationWarning, match=r"use RayExecutor\(RayExecutor.create_settings"):
        executor = ElasticRayExecutor(settings, cpus_per_slot=2, env_vars={"A": 1})
    job = executor._executor
    assert (job.elastic.min_workers, job.elastic.max_workers) == (2, 6)
    assert (job.elastic.reset_limit, job.elastic.elastic_timeout_s) == (3, 60)
    assert job.elastic.cooldown_range == (1, 5) and job.elastic.discovery is None
    assert job.layout.cpus_per_worker == 2 and job.settings.nics == ("lo",)
    assert executor.env_vars == {"A": "1"}
    assert isinstance(settings.discovery, RayHostDiscovery)  # as horovod.ray sets it


def test_horovods_own_elastic_settings_are_taken(caplog):
    from horovod.runner.elastic.discovery import FixedHosts
    from horovod.runner.elastic.settings import ElasticSettings

    hosts = FixedHosts({"10.0.0.1": 2})
    theirs = ElasticSettings(hosts, 2, 4, 60, 5, verbose=2, nics={"eth0"})
    with pytest.warns(DeprecationWarning):
        executor = ElasticRayExecutor(theirs, override_discovery=False)
    assert (executor.settings.min_num_proc, executor.settings.max_num_proc) == (2, 4)
    assert (executor.settings.elastic_timeout, executor.settings.reset_limit) == (60, 5)
    assert executor.settings.verbose == 2 and executor.settings.job.nics == ("eth0",)
    assert executor.settings.discovery is hosts
    with caplog.at_level("WARNING", logger="horovod_ray.elastic"):
        ElasticRayExecutor.create_settings(output_filename="out", ssh_port=22)
    assert "output_filename, ssh_port ignored" in caplog.text


def test_override_discovery_false_uses_the_settings_discovery_as_it_is_at_start():
    settings = ElasticRayExecutor.create_settings(min_num_proc=1)
    with pytest.warns(DeprecationWarning):
        executor = ElasticRayExecutor(settings, override_discovery=False)
    with pytest.raises(ConfigError) as info:
        executor.start()  # before Ray is looked for
    assert info.value.parameter == "override_discovery" and "settings.discovery" in str(info.value)
    settings.discovery = RayHostDiscovery(cpus_per_slot=2)  # set after the executor, as there
    with pytest.raises(horovod_ray.HorovodRayError, match="Ray is not initialised"):
        executor.start()
    assert executor._executor.elastic.discovery is settings.discovery


@pytest.mark.parametrize(
    "settings_kwargs, executor_kwargs, parameter",
    [
        ({"min_num_proc": 0}, {}, "min_num_proc"),
        ({"min_np": 0}, {}, "min_np"),
        ({"min_num_proc": 3, "max_np": 2}, {}, "max_np"),
        ({"no_such": 1}, {}, "no_such"),
        ({"reset_limit": -1}, {}, "reset_limit"),
        ({}, {"gpus_per_slot": 1}, "gpus_per_slot"),
        ({}, {"use_gpu": True, "gpus_per_slot": -2}, "gpus_per_slot"),
        ({}, {"cpus_per_slot": 0}, "cpus_per_slot"),
        ({}, {"env_vars": {"HOROVOD_RANK": "1"}}, "env_vars"),
        ({}, {"override_discovery": "yes"}, "override_discovery"),
    ],
)
def test_elastic_executor_bad_input_names_the_parameter(
    settings_kwargs, executor_kwargs, parameter
):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(ConfigError) as info:
            settings = ElasticRayExecutor.create_settings(**settings_kwargs)
            ElasticRayExecutor(settings, **executor_kwargs)
    assert info.value.parameter == parameter


def test_ray_host_discovery_counts_as_horovod_ray_and_tells_one_machines_nodes_apart():
    def node(node_id: str, address: str, cpus: float, gpus: float = 0, alive=True) -> dict:
        resources = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
        return {"NodeID": node_id, "NodeManagerAddress": address, "Alive": alive,
                "Resources": resources}  # fmt: skip

    cluster = [
        node("a", "10.0.0.1", 8, 2),
        node("b", "10.0.0.2", 3),
        node("c", "10.0.0.3", 8, alive=False),
    ]
    assert hosts_and_slots(cluster, 2, None) == {"10.0.0.1": 4, "10.0.0.2": 1}
    assert hosts_and_slots(cluster, 2, 1) == {"10.0.0.1": 2}  # the fewer of CPUs and GPUs
    one_machine = [node("a", "127.0.0.1", 2), node("b", "127.0.0.1", 4)]
    assert hosts_and_slots(one_machine, 1, None) == {"a": 2, "b": 4}
