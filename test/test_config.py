"""Ray Train's config objects as horovod_ray's keywords (``horovod_ray.config``), without
Ray: what each field becomes, and what is refused, naming the field."""

from __future__ import annotations

import pytest
from ray import tune
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig

from horovod_ray import ConfigError, RayExecutor, config
from horovod_ray.job.layouts import ElasticLayout, WorkerLayout

pytestmark = pytest.mark.unit  # pure logic: no Ray (make test runs these first)


@pytest.mark.parametrize(
    "scaling, keywords",
    [
        (ScalingConfig(num_workers=3), {"num_workers": 3}),  # PACK: packed anywhere
        (
            ScalingConfig(num_workers=3, placement_strategy="STRICT_SPREAD"),
            {"num_hosts": 3, "num_workers_per_host": 1},
        ),
        (
            ScalingConfig(num_workers=3, placement_strategy="STRICT_PACK"),
            {"num_hosts": 1, "num_workers_per_host": 3},
        ),
        (ScalingConfig(num_workers=(2, 4)), {"min_workers": 2, "max_workers": 4}),
        (
            ScalingConfig(num_workers=(2, 4), elastic_resize_monitor_interval_s=5),
            {"min_workers": 2, "max_workers": 4, "discovery_interval_s": 5},
        ),
        (
            ScalingConfig(num_workers=2, use_gpu=True, resources_per_worker={"CPU": 4, "GPU": 2}),
            {"num_workers": 2, "use_gpu": True, "cpus_per_worker": 4, "gpus_per_worker": 2},
        ),
    ],
    ids=["pack", "strict-spread", "strict-pack", "elastic", "elastic-interval", "resources"],
)
def test_a_scaling_config_becomes_the_executors_sizing(scaling, keywords):
    assert config.scaling(scaling) == {"use_gpu": False, **keywords}


def test_a_run_config_becomes_the_runs_storage_and_restarts():
    keep = CheckpointConfig(num_to_keep=2)
    wanted = config.run(
        RunConfig(
            name="n",
            storage_path="/data",
            checkpoint_config=keep,
            failure_config=FailureConfig(max_failures=3),
        )
    )
    assert wanted == {
        "storage_path": "/data",
        "name": "n",
        "checkpoint_config": keep,
        "max_restarts": 3,
    }
    assert "max_restarts" not in config.run(tune.RunConfig(name="n"))  # Tune's, no failures
    # What Ray's RunConfig fills in by itself (~/ray_results, a CheckpointConfig, a
    # FailureConfig) is not asked; a named run keeps Ray's default folder.
    assert config.run(RunConfig()) == {}
    assert config.run(RunConfig(name="n"))["storage_path"] == RunConfig().storage_path


def test_a_run_config_of_restarts_alone_goes_beside_settings_that_store_the_run(tmp_path):
    settings = RayExecutor.create_settings(name="n", storage_path=str(tmp_path))
    executor = RayExecutor(
        settings, num_workers=2, run_config=RunConfig(failure_config=FailureConfig(2))
    )
    assert executor.settings == settings and executor._restarts.policy.max_restarts == 2


def test_an_executor_from_configs_is_the_one_from_keywords(tmp_path):
    from_ray = RayExecutor(
        scaling_config=ScalingConfig(
            num_workers=2, placement_strategy="STRICT_SPREAD", resources_per_worker={"CPU": 2}
        ),
        run_config=RunConfig(
            name="n", storage_path=str(tmp_path), failure_config=FailureConfig(max_failures=2)
        ),
    )
    settings = RayExecutor.create_settings(name="n", storage_path=str(tmp_path))
    flat = RayExecutor(settings, num_hosts=2, cpus_per_worker=2, max_restarts=2)
    assert from_ray.layout == flat.layout
    assert from_ray.settings == settings
    assert from_ray._restarts.policy == flat._restarts.policy
    elastic = RayExecutor(scaling_config=ScalingConfig(num_workers=(1, 3)))
    assert elastic.elastic == ElasticLayout(min_workers=1, max_workers=3)
    assert elastic.layout == WorkerLayout(num_workers=1)


@pytest.mark.parametrize(
    "arguments, parameter, says",
    [
        ({"scaling_config": {"num_workers": 2}}, "scaling_config", "must be a ray.train.Scaling"),
        ({"run_config": "runs/"}, "run_config", "must be a ray.train.RunConfig"),
        (
            {"scaling_config": ScalingConfig(num_workers=2), "num_workers": 2},
            "scaling_config",
            "scaling_config and num_workers both",
        ),
        (
            {"scaling_config": ScalingConfig(num_workers=2), "num_slots": 2},
            "scaling_config",
            "scaling_config and num_slots both",
        ),
        (
            {"run_config": RunConfig(failure_config=FailureConfig(1)), "max_restarts": 2},
            "run_config",
            "run_config and max_restarts both",
        ),
        (
            {
                "settings": RayExecutor.create_settings(name="a"),
                "run_config": RunConfig(name="b"),
            },
            "run_config",
            "both say where the run goes",
        ),
        (
            {"scaling_config": ScalingConfig(num_workers=2, placement_strategy="SPREAD")},
            "scaling_config.placement_strategy",
            "SPREAD's best effort",
        ),
        (
            {"scaling_config": ScalingConfig(num_workers=(1, 3), placement_strategy="STRICT_PACK")},
            "scaling_config.placement_strategy",
            "leave placement_strategy as PACK",
        ),
        (
            {"scaling_config": ScalingConfig(num_workers=2, resources_per_worker={"memory": 1})},
            "scaling_config.resources_per_worker",
            "may hold CPU and GPU",
        ),
        (
            {"scaling_config": ScalingConfig(num_workers=2, accelerator_type="A100")},
            "scaling_config.accelerator_type",
            "not supported",
        ),
        (
            {"scaling_config": ScalingConfig(num_workers=0)},
            "scaling_config.num_workers",
            "local=True",
        ),
        (
            {
                "scaling_config": ScalingConfig(
                    num_workers=(1, 3), elastic_resize_monitor_interval_s=0
                )
            },
            "scaling_config.elastic_resize_monitor_interval_s",
            "finite number of seconds",
        ),
        ({"run_config": tune.RunConfig(stop={"epoch": 3})}, "run_config.stop", "stopping rule"),
        (
            {"run_config": RunConfig(failure_config=FailureConfig(max_failures=-1))},
            "run_config.failure_config.max_failures",
            "retry forever",
        ),
        (
            {
                "scaling_config": ScalingConfig(num_workers=(1, 3)),
                "run_config": RunConfig(failure_config=FailureConfig(max_failures=1)),
            },
            "run_config.failure_config.max_failures",
            "recovers in place",
        ),
    ],
)
def test_what_horovod_ray_cannot_honour_is_refused_naming_the_field(arguments, parameter, says):
    with pytest.raises(ConfigError, match=says) as info:
        RayExecutor(**arguments)
    assert info.value.parameter == parameter


def test_the_elastic_and_failure_keywords_a_config_leaves_unset_go_beside_it():
    executor = RayExecutor(
        scaling_config=ScalingConfig(num_workers=(1, 3)), reset_limit=2, cooldown_range=(1, 5)
    )
    assert (executor.elastic.reset_limit, executor.elastic.cooldown_range) == (2, (1, 5))
    executor = RayExecutor(num_workers=2, max_restarts=1, run_config=RunConfig(name="n"))
    assert executor._restarts.policy.max_restarts == 1  # no failure_config: the keyword's
